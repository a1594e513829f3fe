"""Kubernetes: the RayService ``serveConfigV2`` rendered from the stack config, and manifest checks.

One config, one path: ``deployments/<env>.yaml`` ->
:func:`serving.control.serve_config.build_serve_config` -> ``k8s/overlays/<env>/serve-config.yaml``,
a kustomize patch that sets the RayService's ``serveConfigV2``. The patch is generated, committed and
checked by a test to be up to date, so ``kubectl kustomize`` needs no plugin and the local stack and
the cluster run the same Serve config. (The manifests are validated against the real CRDs by the
tests: ``tests/support/manifests.py``.)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from serving.config import StackConfig, load_config
from serving.record import LiveEntry

__all__ = [
    "K8sError",
    "Live",
    "as_written",
    "committed_live",
    "store_live",
    "image_transformer",
    "overlay_envs",
    "render_overlays",
    "render_serve_config_v2",
    "serve_config_patch",
    "stale_k8s",
    "write_k8s",
]

RAYSERVICE_NAME = "raystack"
SERVE_PATCH = "serve-config.yaml"
IMAGE_TRANSFORMER = "image.yaml"
BASE_IMAGE = "ghcr.io/raystack/raystack-llm"  # the image name k8s/base and the overlays' patches use
K8S_HOSTS = ("0.0.0.0", "::")
# What the manifests under k8s/ hard-code (the serve Service, containerPorts, NetworkPolicies and
# the serving pods' lifecycle); tests/unit/test_config_checks.py reads them back from the files.
K8S_MANIFESTS = "k8s/base/namespaced/rayservice.yaml"
K8S_GATEWAY_PORT = 8000
K8S_PROXY_PORT = 8001
K8S_PRESTOP_SLEEP_S = 5
K8S_TERMINATION_GRACE_S = 90


class K8sError(ValueError):
    """A stack config cannot run on Kubernetes, or kustomize/kubectl failed (message says why)."""


# --- serveConfigV2 ---------------------------------------------------------------------------


def _check_for_k8s(cfg: StackConfig, source: str) -> None:
    """On Kubernetes every checkpoint is an absolute path (a mounted volume) or a URI, and the
    Serve proxies listen on the pod IP; a config that violates either would deploy and then fail."""
    for m in cfg.models:
        for v in m.versions:
            path = cfg.version_path(m, v, None)
            if "://" not in path and not path.startswith("/"):
                raise K8sError(
                    f"{source}: models[{m.name}].versions[{v.version}]: checkpoint path {path!r} is "
                    "relative; on Kubernetes checkpoint_root (or the version's path) must be an "
                    "absolute path such as /mnt/checkpoints or a URI such as s3://bucket/models"
                )
    if cfg.auth.mode == "open":
        raise K8sError(
            f"{source}: auth.mode is 'open' (no API keys); that is for a local stack only. On "
            "Kubernetes use mode: keys with tenants whose keys come from the Secret raystack-api-keys"
        )
    if cfg.gateway.host not in K8S_HOSTS:
        raise K8sError(
            f"{source}: gateway.host is {cfg.gateway.host!r}; on Kubernetes the Serve proxies must "
            "listen on the pod IP: set gateway.host: 0.0.0.0"
        )
    _check_manifest_values(cfg, source)


def _check_manifest_values(cfg: StackConfig, source: str) -> None:
    """The ports and the draining budget the manifests fix: a config that differs would serve
    where no Service or NetworkPolicy leads, or have its replicas killed mid-drain."""
    g, sd = cfg.gateway, cfg.shutdown
    if g.port != K8S_GATEWAY_PORT:
        raise K8sError(
            f"{source}: gateway.port is {g.port}; the Kubernetes manifests ({K8S_MANIFESTS}: the serve Service, "
            f"containerPorts, NetworkPolicies) serve the gateway on {K8S_GATEWAY_PORT}: set gateway.port: "
            f"{K8S_GATEWAY_PORT}"
        )
    if g.ingress == "listener" and g.serve_proxy_port != K8S_PROXY_PORT:
        raise K8sError(
            f"{source}: Serve's HTTP proxy port (gateway.proxy_port, default gateway.port + 1) is "
            f"{g.serve_proxy_port}; the Kubernetes manifests (NetworkPolicies) open {K8S_PROXY_PORT} for it: "
            f"set gateway.proxy_port: {K8S_PROXY_PORT} or leave it unset"
        )
    # the pod's grace covers the preStop sleep (the load balancers' notice) and then Serve's drain
    need = max(sd.notice_s, K8S_PRESTOP_SLEEP_S) + sd.grace_s
    if need > K8S_TERMINATION_GRACE_S:
        raise K8sError(
            f"{source}: shutdown.notice_s + shutdown.grace_s is {sd.notice_s:g} + {sd.grace_s:g} s (with the "
            f"manifests' preStop `sleep {K8S_PRESTOP_SLEEP_S}`: {need:g} s); the serving pods' "
            f"terminationGracePeriodSeconds in {K8S_MANIFESTS} is {K8S_TERMINATION_GRACE_S}: lower shutdown.grace_s "
            f"to at most {K8S_TERMINATION_GRACE_S - max(sd.notice_s, K8S_PRESTOP_SLEEP_S):g}"
        )


def for_k8s(cfg: StackConfig) -> StackConfig:
    """The stack config as it runs on Kubernetes: its controller patches the RayService."""
    return cfg.model_copy(update={"controller": cfg.controller.model_copy(update={"target": "kubernetes"})})


def render_serve_config_v2(config_path: str | Path, live: Live | None = None) -> str:
    """The RayService ``serveConfigV2`` (a YAML string) for a stack config file, with ``live``
    (the promotion record's live versions and weights) applied over the versions as written, as
    ``serving up`` applies them (:func:`~serving.control.controller.with_live`); the promotion
    controller's app keeps the config as written (its seed)."""
    from serving.control.controller import with_live
    from serving.control.k8s_apply import serve_config_v2

    seed = for_k8s(load_config(config_path))
    cfg = with_live(seed, live) if live else seed
    _check_for_k8s(cfg, str(config_path))
    return serve_config_v2(cfg, seed)


# --- the record of live versions -------------------------------------------------------------

Live = dict[str, list[LiveEntry]]  # per model: (version, weight) or (version, weight, manifest sha256)
# A Callable giving the live versions to render for (stack config, path of the committed patch).
LiveSource = Callable[[StackConfig, Path], Live]
LIVE_HEADER = "# live versions from the promotion record: "


def _entry(version: Any, weight: Any, pin: Any = None) -> LiveEntry:
    return (str(version), int(weight), str(pin)) if pin else (str(version), int(weight))


def committed_live(cfg: StackConfig, patch: Path) -> Live:
    """The live versions the committed ``patch`` was rendered with (its header line; {} if none):
    what a check compares against without the store, and what a render keeps where the store
    is not reachable."""
    if not patch.is_file():
        return {}
    for line in patch.read_text().splitlines():
        if line.startswith(LIVE_HEADER):
            data = json.loads(line[len(LIVE_HEADER) :])
            return {m: [_entry(*e) for e in vs] for m, vs in data.items()}
        if not line.startswith("#"):
            break
    return {}


def as_written(cfg: StackConfig, patch: Path) -> Live:
    """No record: the versions of the stack config file."""
    return {}


def store_live(cfg: StackConfig, patch: Path) -> Live:
    """The store's record of live versions (models of this config only); where the store is not
    reachable from here (a local root that does not exist, such as a cluster's volume), the
    versions the committed patch was last rendered with, so a render never drops a promotion."""
    from serving.record import ControlStore

    root = cfg.store_root(None)
    if "://" not in root and not Path(root).is_dir():
        return committed_live(cfg, patch)
    try:
        record = ControlStore(root, cfg.name).live()
    except (OSError, ValueError) as exc:
        raise K8sError(
            f"cannot read the promotion record under {root}/.control/{cfg.name}: {type(exc).__name__}: {exc}; "
            "render where the store is readable, or pass --as-written for the versions of the YAML"
        ) from None
    names = {m.name for m in cfg.models}
    return {m: [v.entry() for v in vs] for m, vs in sorted(record.items()) if m in names}


class _LiteralDumper(yaml.SafeDumper):
    pass


def _str_presenter(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_LiteralDumper.add_representer(str, _str_presenter)


def serve_config_patch(config_path: str | Path, source_label: str | None = None, live: Live | None = None) -> str:
    """The kustomize patch file (strategic merge) that sets the RayService ``serveConfigV2``;
    with ``live``, a header line names the record applied (so a check can render it again)."""
    label = source_label or str(config_path)
    patch = {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": RAYSERVICE_NAME},
        "spec": {"serveConfigV2": render_serve_config_v2(config_path, live)},
    }
    header = (
        f"# GENERATED by `serving render-k8s` from {label} -- do not edit by hand.\n"
        "# Edit the stack config, re-render, commit both; tests/unit/test_k8s.py fails on drift.\n"
    )
    if live:
        header += LIVE_HEADER + json.dumps(live, sort_keys=True, separators=(",", ":")) + "\n"
    return header + yaml.dump(patch, Dumper=_LiteralDumper, sort_keys=False, width=100)


def image_transformer(config_path: str | Path, source_label: str | None = None) -> str:
    """The kustomize ImageTagTransformer that sets every Ray pod's image to the stack config's
    ``kubernetes.image`` (a tag, a digest, or both: a digest wins, as kustomize renders it)."""
    from serving.config import IMAGE_RE

    image = load_config(config_path).kubernetes.image
    m = IMAGE_RE.match(image)
    assert m is not None  # validated by the config
    tag: dict[str, str] = {"name": BASE_IMAGE, "newName": m["repo"]}
    if m["digest"]:
        tag["digest"] = m["digest"]
    else:
        tag["newTag"] = m["tag"]
    doc = {
        "apiVersion": "builtin",
        "kind": "ImageTagTransformer",
        "metadata": {"name": "raystack-image"},
        "imageTag": tag,
    }
    header = (
        f"# GENERATED by `serving render-k8s` from {source_label or config_path} (kubernetes.image) -- do not\n"
        "# edit by hand. Listed under `transformers:` in this overlay's kustomization.yaml.\n"
    )
    return header + yaml.safe_dump(doc, sort_keys=False)


def overlay_envs(repo_root: Path) -> list[str]:
    """Environments with both a stack config ``deployments/<env>.yaml`` and an overlay."""
    overlays = repo_root / "k8s" / "overlays"
    return sorted(
        p.stem
        for p in (repo_root / "deployments").glob("*.yaml")
        if (overlays / p.stem / "kustomization.yaml").is_file()
    )


def render_overlays(repo_root: Path, env: str | None = None, live: LiveSource = committed_live) -> dict[Path, str]:
    """What the generated files should contain: ``{k8s/overlays/<env>/<file>: text}`` for the
    serveConfigV2 patch and the image transformer of each environment. ``live`` gives the live
    versions to apply: by default those the committed patch names (what CI can check without the
    store); ``serving render-k8s`` reads the store (:func:`store_live`) unless ``--as-written``."""
    repo_root = Path(repo_root)
    envs = overlay_envs(repo_root)
    if env is not None:
        if env not in envs:
            raise K8sError(
                f"no environment {env!r}: need deployments/{env}.yaml and "
                f"k8s/overlays/{env}/kustomization.yaml (have: {', '.join(envs) or 'none'})"
            )
        envs = [env]
    out: dict[Path, str] = {}
    for name in envs:
        config = repo_root / "deployments" / f"{name}.yaml"
        label = config.relative_to(repo_root).as_posix()
        patch = repo_root / "k8s" / "overlays" / name / SERVE_PATCH
        out[patch] = serve_config_patch(config, label, live(load_config(config), patch))
        out[repo_root / "k8s" / "overlays" / name / IMAGE_TRANSFORMER] = image_transformer(config, label)
    return out


def write_k8s(repo_root: Path, env: str | None = None, live: LiveSource = committed_live) -> list[Path]:
    """Render the generated files of one environment (or all) and write them; returns the paths.

    The entry point of ``serving render-k8s``. Files whose content is unchanged are not rewritten.
    """
    written: list[Path] = []
    for path, text in render_overlays(Path(repo_root), env, live).items():
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
        written.append(path)
    return written


def stale_k8s(repo_root: Path, env: str | None = None, live: LiveSource = committed_live) -> list[Path]:
    """Generated files that are missing or differ from a fresh render (for CI: empty = up to date)."""
    return [
        path
        for path, text in render_overlays(Path(repo_root), env, live).items()
        if not path.is_file() or path.read_text() != text
    ]
