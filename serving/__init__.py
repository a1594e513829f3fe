"""raystack-llm: many LLMs on Ray Serve and vLLM behind one OpenAI-compatible gateway.

The package is laid out by the two paths through the system:

- **Request path (data plane)**: :mod:`serving.gateway` (the ingress: listener, routes,
  admission, routing, replica finder, relay) and :mod:`serving.replica` (one model replica: a
  vLLM OpenAI server as a child process, its CPU placement, request routers). They never import
  each other; both import :mod:`serving.contract`, the only module they share besides the error
  tree (:mod:`serving.errors`), the metrics (:mod:`serving.metrics`) and the config types.
- **Control path (control plane)**: :mod:`serving.control` turns a stack config into a Serve
  config, runs the local stack, promotes checkpoints, renders Kubernetes manifests, and is the
  ``serving`` CLI. Nothing in the data plane imports it.

Shared by both: :mod:`serving.config` (the validated stack config) and :mod:`serving.registry`
(the checkpoint store). ``docs/architecture.md`` walks a streamed request and a promotion
through these modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from serving.config import ConfigError, ModelConfig, StackConfig, load_config, parse_config
from serving.manifest import Manifest
from serving.registry import CheckpointStore, RegistryError

if TYPE_CHECKING:
    from serving.control.serve_config import app_name, build_serve_config

__all__ = [
    "CheckpointStore",
    "ConfigError",
    "Manifest",
    "ModelConfig",
    "RegistryError",
    "StackConfig",
    "app_name",
    "build_serve_config",
    "load_config",
    "parse_config",
]


def __getattr__(name: str) -> Any:
    """The control-plane names load on first use, so importing the data plane never loads it."""
    if name in ("app_name", "build_serve_config"):
        from serving.control import serve_config

        return getattr(serve_config, name)
    raise AttributeError(f"module 'serving' has no attribute {name!r}")
