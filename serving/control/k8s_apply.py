"""On Kubernetes a promotion step is a patch of the RayService's ``serveConfigV2``.

Why a patch of the RayService and not a Serve apply inside the cluster: KubeRay owns the cluster's
Serve config. It re-applies ``serveConfigV2`` to every cluster it creates (blue/green) and after an
operator restart, so a step applied only through Serve would be undone by the next of those; a
step written into the RayService is what the next cluster serves too. KubeRay applies a changed
``serveConfigV2`` in place (no new cluster).

The document is built by the same code as ``serving render-k8s`` (:func:`serve_config_v2`), checked
with Ray Serve's own ``ServeDeploySchema`` before it is sent, and sent as a JSON merge patch with
the pod's service-account token to the API server. The controller's pods run under the service
account ``raystack-promoter`` whose Role allows ``get`` and ``patch`` of this one RayService only
(``k8s/base/namespaced/promotion-rbac.yaml``). A ``git`` re-apply of the rendered overlay (the
config as written) is corrected at the controller's next poll: it compares the RayService's
``serveConfigV2`` with the record's and patches it back. An *edited* config applied by the operator
is not: its controller application's args (the stack config as written) differ from this
controller's, and Serve restarts the controller with them, so this one patches nothing (each poll
says so) and the restarted one applies the record over the new config.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx
import yaml

from serving.config import StackConfig
from serving.control.serve_config import CONTROLLER_APP, build_serve_config

__all__ = ["RayServiceApplier", "patch_document", "serve_config_v2", "validate_serve_config"]

logger = logging.getLogger("raystack.promotion")

RAYSERVICE_NAME = "raystack"
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
API = "https://kubernetes.default.svc"


def validate_serve_config(config: dict[str, Any]) -> None:
    """Raise if Ray Serve's own schema (what KubeRay's cluster will parse) rejects ``config``."""
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(config)


def serve_config_v2(cfg: StackConfig, seed: StackConfig, read_manifests: bool = False) -> str:
    """The ``serveConfigV2`` string for ``cfg`` (live versions applied) of the stack ``seed``;
    ``read_manifests``: each version's ``created`` from its manifest (the controller, which reaches
    the store, does; an offline render does not)."""
    config = build_serve_config(cfg, base=None, read_manifests=read_manifests, seed=seed)
    validate_serve_config(config)
    return yaml.safe_dump(config, sort_keys=False)


def patch_document(cfg: StackConfig, seed: StackConfig, read_manifests: bool = False) -> dict[str, Any]:
    """The JSON merge patch of the RayService that applies ``cfg``."""
    return {"spec": {"serveConfigV2": serve_config_v2(cfg, seed, read_manifests)}}


def _controller_args(doc: Any) -> dict[str, Any] | None:
    """The promotion controller application's args in a ``serveConfigV2`` document, if any."""
    try:
        apps = (yaml.safe_load(doc) or {}).get("applications", []) if isinstance(doc, str) else []
    except yaml.YAMLError:
        return None
    args = next((a.get("args") for a in apps if isinstance(a, dict) and a.get("name") == CONTROLLER_APP), None)
    return args if isinstance(args, dict) else None


class RayServiceApplier:
    """Applies configs by patching the RayService; reads status and metrics from the Serve
    instance the controller runs in (``local``)."""

    reconcile_each_poll = True

    def __init__(
        self,
        seed: StackConfig,
        local: Any,
        sa_dir: Path = SA_DIR,
        api: str = API,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.seed, self.local, self.sa_dir, self.api, self.transport = seed, local, sa_dir, api, transport
        namespace = (sa_dir / "namespace").read_text().strip() if (sa_dir / "namespace").exists() else "raystack"
        self.url = f"{api}/apis/ray.io/v1/namespaces/{namespace}/rayservices/{RAYSERVICE_NAME}"

    def _client(self) -> httpx.Client:
        token = (self.sa_dir / "token").read_text().strip()  # re-read: the kubelet rotates it
        ca = self.sa_dir / "ca.crt"
        return httpx.Client(
            headers={"authorization": f"Bearer {token}"},
            verify=str(ca) if ca.exists() else True,
            timeout=30,
            transport=self.transport,
        )

    def apply(self, cfg: StackConfig) -> None:
        patch = patch_document(cfg, self.seed, read_manifests=True)
        with self._client() as client:
            current = client.get(self.url)
            current.raise_for_status()
            doc = current.json().get("spec", {}).get("serveConfigV2")
            if doc == patch["spec"]["serveConfigV2"]:
                return
            theirs = _controller_args(doc)
            if theirs is not None and theirs != _controller_args(patch["spec"]["serveConfigV2"]):
                raise RuntimeError(
                    f"RayService {RAYSERVICE_NAME} holds another stack config than this controller's (an edit "
                    "applied to it); not patched: Serve restarts the controller with that config, which applies "
                    "the record over it"
                )
            r = client.patch(self.url, json=patch, headers={"content-type": "application/merge-patch+json"})
            if r.status_code >= 400:
                raise RuntimeError(f"patch of RayService {RAYSERVICE_NAME} refused ({r.status_code}): {r.text[:500]}")
        logger.info("patched RayService %s serveConfigV2", RAYSERVICE_NAME)

    def app_status(self, app: str) -> tuple[str, str]:
        status: tuple[str, str] = self.local.app_status(app)
        return status

    def metrics_by_node(self) -> dict[str, str | None]:
        texts: dict[str, str | None] = self.local.metrics_by_node()
        return texts
