"""The models a stack config names that are not built yet: ``serving up`` trains each version
that has a recipe with the training job (``python -m training.train``, in a process of its own
that starts its own private Ray) before it deploys it, and says which version lacks both weights
and a recipe. A model can be deployed before the rest are built when the models built so far form
a valid stack on their own (:func:`servable`, :func:`only_models`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from serving.config import ModelConfig, ModelVersion, StackConfig
from serving.redact import redact_uri
from serving.replica.engine import check_layout

__all__ = ["check_version_layout", "ensure_models", "only_models", "servable"]


def _built(cfg: StackConfig, model: ModelConfig, version: ModelVersion, base: Path) -> bool:
    """Whether a version's weights are there (a remote URI is checked where it is loaded)."""
    path = cfg.version_path(model, version, base)
    return "://" in path or (Path(path) / ("adapter_config.json" if model.base else "config.json")).exists()


def ensure_models(cfg: StackConfig, base: Path, log: Any = print, on_built: Callable[[], None] | None = None) -> None:
    """Train every version that is missing locally and has a recipe; fail clearly otherwise;
    then check each model's parallel layout against its checkpoint and this machine. Versions
    with a recipe come first: a ``path:`` version may be another name for one of them.
    ``on_built`` is called after each training job that leaves another one to run."""
    versions = sorted(((m, v) for m in cfg.models for v in m.versions), key=lambda mv: mv[1].recipe is None)
    jobs = sum(1 for m, v in versions if v.recipe is not None and not _built(cfg, m, v, base))
    for m, v in versions:
        path = cfg.version_path(m, v, base)
        if "://" in path:
            continue
        built_now = not _built(cfg, m, v, base)
        if built_now:
            if v.recipe is None:
                raise FileNotFoundError(f"{m.name}@{v.version}: no checkpoint at {path} and no recipe")
            r = v.recipe
            where = f"from {redact_uri(r.base)} on {redact_uri(r.data)}"  # a URI may carry a credential
            log(f"building {m.name}@{v.version} {where} with the training job...")
            p = Path(path)  # <root>/<model>/<version>
            # its own process: the job starts (and stops) its own private, authenticated Ray
            cmd = [sys.executable, "-m", "training.train", "--root", str(p.parent.parent)]
            cmd += ["--model", p.parent.name, "--version", p.name]
            cmd += ["--method", r.method, "--seed", str(r.seed)]
            cmd += ["--steps", str(r.steps)] if r.steps else []
            cmd += ["--lora-rank", str(r.lora_rank)] if r.lora_rank else []
            cmd += ["--lora-alpha", str(r.lora_alpha)] if r.lora_alpha else []
            uris = ["--base", r.base, "--data", r.data] + (["--eval", r.eval] if r.eval else [])
            if _run_job(cmd, uris) != 0:
                raise RuntimeError(f"{m.name}@{v.version}: the training job failed (its output is above)")
            jobs -= 1
        check_version_layout(cfg, m, v, base)
        if built_now and jobs and on_built is not None:
            on_built()


def _run_job(cmd: list[str], uris: list[str]) -> int:
    """Run the training job ``cmd`` with the base, data and eval arguments ``uris`` in an
    argument file (``@FILE``, mode 0600, removed after) rather than on its command line, which
    every local user sees: a URI may carry a credential."""
    with tempfile.NamedTemporaryFile("w", prefix="raystack-train-args-", suffix=".txt") as fh:
        fh.write("\n".join(uris) + "\n")
        fh.flush()
        return subprocess.run([*cmd, f"@{fh.name}"], check=False).returncode


def check_version_layout(cfg: StackConfig, model: ModelConfig, version: ModelVersion, base: Path) -> None:
    """A local version's parallel layout against its checkpoint and this machine (an adapter runs
    in its base's layout; a remote one is checked where it is loaded)."""
    path = cfg.version_path(model, version, base)
    if model.base is None and "://" not in path:
        hf = json.loads((Path(path) / "config.json").read_text())
        check_layout(model, hf, float(cfg.local_ray.num_cpus), None)


def servable(cfg: StackConfig, base: Path) -> set[str]:
    """The models that can be served now: every version built, and an adapter's base among them."""
    built = {m.name for m in cfg.models if all(_built(cfg, m, v, base) for v in m.versions)}
    return {m.name for m in cfg.models if m.name in built and (m.base is None or m.base in built)}


def only_models(cfg: StackConfig, names: set[str]) -> StackConfig | None:
    """``cfg`` with only the models ``names``; None where that is no valid stack (none left, or
    the gateway's default model, a tenant's model or an adapter's base is among the others)."""
    data = cfg.model_dump()
    data["models"] = [m for m in data["models"] if m["name"] in names]
    try:
        return StackConfig.model_validate(data)
    except ValidationError:
        return None
