"""The safe Kubernetes defaults, checked on the rendered overlays (no cluster): Ray token auth,
GCS fault tolerance in production, API tokens only where used, the image from the stack config
(digest-pinnable), no pod but the checkpoint readers near the instance-metadata address, and
configs that would deploy insecurely refused at render time."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from serving.config import ConfigError, load_config
from serving.control.k8s import K8sError, image_transformer, render_serve_config_v2
from tests.support.manifests import find_kubectl, kustomize_build
from tests.unit.test_k8s_policy import (
    OVERLAYS,
    OVERLAYS_DIR,
    REPO,
    cluster_spec,
    images,
    of_kind,
    pod_labels,
    port_open,
    ray_groups,
    render,
    selects,
)

pytestmark = pytest.mark.skipif(find_kubectl() is None, reason="kubectl not found")  # test_k8s.py fails loudly

SA_TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
METADATA = "169.254.169.254"
DIGEST = "sha256:" + "0123456789abcdef" * 4


def _env_of(overlay: str) -> str:
    """The deployments/<env>.yaml an overlay serves (itself or the overlay it builds on)."""
    return overlay if (REPO / "deployments" / f"{overlay}.yaml").is_file() else overlay.rsplit("-", 1)[0]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_ray_cluster_uses_ray_token_auth(overlay: str) -> None:
    """The serving cluster and the training job's: without it the job API accepts anyone who
    reaches the head (NetworkPolicy is not enforced by every network plugin)."""
    (rs,) = of_kind(overlay, "RayService")
    (job,) = of_kind(overlay, "RayJob")
    for o in (rs, job):
        assert cluster_spec(o)["authOptions"] == {"mode": "token"}, o["kind"]
        for where, _, g in ray_groups(o):
            for c in g["template"]["spec"]["containers"]:
                assert not any(e["name"] == "RAY_AUTH_MODE" for e in c.get("env", [])), where


@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if o.startswith("gpu-prod")])
def test_production_has_gcs_fault_tolerance(overlay: str) -> None:
    (rs,) = of_kind(overlay, "RayService")
    ft = rs["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    assert ft["redisAddress"] and ft["redisPassword"]["valueFrom"]["secretKeyRef"] == {
        "name": "raystack-redis",
        "key": "password",
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_an_api_token_is_mounted_only_into_the_autoscaler_and_the_promotion_controller(overlay: str) -> None:
    """No Ray pod automounts a service-account token; the serving head gives a projected token to
    its autoscaler sidecar, and the promotion group's container alone mounts one, under its own
    account, whose Role allows get and patch of the one RayService and nothing else."""
    for o in of_kind(overlay, "RayService", "RayJob"):
        for where, _, g in ray_groups(o):
            pod = g["template"]["spec"]
            assert pod.get("automountServiceAccountToken") is False, where
            promoter = o["kind"] == "RayService" and g.get("groupName") == "promotion"
            assert (pod["serviceAccountName"] == "raystack-promoter") is promoter, where
            for c in pod["containers"]:
                assert (SA_TOKEN_PATH in {m["mountPath"] for m in c.get("volumeMounts", [])}) is promoter, where
    (rs,) = of_kind(overlay, "RayService")
    cs = cluster_spec(rs)
    mounts = {m["mountPath"]: m["name"] for m in cs["autoscalerOptions"]["volumeMounts"]}
    volumes = {v["name"]: v for v in cs["headGroupSpec"]["template"]["spec"]["volumes"]}
    sources = volumes[mounts[SA_TOKEN_PATH]]["projected"]["sources"]
    assert any("serviceAccountToken" in s for s in sources)
    for sa in of_kind(overlay, "ServiceAccount"):
        assert sa.get("automountServiceAccountToken") is False, sa["metadata"]["name"]
    assert not of_kind(overlay, "ClusterRole", "ClusterRoleBinding")
    (role,) = of_kind(overlay, "Role")
    assert role["metadata"]["name"] == "raystack-promoter"
    assert role["rules"] == [
        {
            "apiGroups": ["ray.io"],
            "resources": ["rayservices"],
            "resourceNames": ["raystack"],
            "verbs": ["get", "patch"],
        }
    ]
    (binding,) = of_kind(overlay, "RoleBinding")
    assert binding["roleRef"]["name"] == "raystack-promoter"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "raystack-promoter", "namespace": "raystack"}]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_ray_pod_runs_the_stack_configs_image(overlay: str) -> None:
    want = load_config(REPO / "deployments" / f"{_env_of(overlay)}.yaml").kubernetes.image
    assert set(images(list(render(overlay)))) == {want}


def test_an_image_pinned_by_digest_reaches_every_ray_pod(tmp_path: Path) -> None:
    data = yaml.safe_load((REPO / "deployments" / "gpu-prod.yaml").read_text())
    data["kubernetes"] = {"image": f"registry.example.com/team/raystack-llm:0.1.0-ray2.60.0@{DIGEST}"}
    config = tmp_path / "gpu-prod.yaml"
    config.write_text(yaml.safe_dump(data))
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "image.yaml").write_text(image_transformer(config))
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {"resources": [os.path.relpath(OVERLAYS_DIR / "gpu-prod", overlay)], "transformers": ["image.yaml"]}
        )
    )
    found = set(images(kustomize_build(overlay)))
    assert found == {f"registry.example.com/team/raystack-llm@{DIGEST}"}


@pytest.mark.parametrize(
    "image",
    ["raystack-llm", "ghcr.io/raystack/raystack-llm:", "ghcr.io/Raystack/x:1", "x@sha256:abc", "x:1 --evil"],
)
def test_a_malformed_image_reference_is_refused(tmp_path: Path, image: str) -> None:
    data = yaml.safe_load((REPO / "deployments" / "gpu-prod.yaml").read_text())
    data["kubernetes"] = {"image": image}
    config = tmp_path / "stack.yaml"
    config.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="kubernetes.image"):
        load_config(config)


def test_auth_mode_open_is_refused_for_kubernetes(tmp_path: Path) -> None:
    data = yaml.safe_load((REPO / "deployments" / "gpu-prod.yaml").read_text())
    data["auth"] = {"mode": "open"}
    data["models"] = [{**m, "aliases": m.get("aliases", [])} for m in data["models"]]
    config = tmp_path / "stack.yaml"
    config.write_text(yaml.safe_dump(data))
    load_config(config)  # a valid stack config (for a local stack) ...
    with pytest.raises(K8sError, match="auth.mode is 'open'"):
        render_serve_config_v2(config)  # ... that does not render for Kubernetes


# --- egress to the instance-metadata address -----------------------------------------------------


def _ip_egress_allowed(policies: list[dict[str, Any]], subject: dict[str, str], ip: str, port: int) -> bool:
    """May a pod with ``subject`` labels open a connection to ``ip:port`` outside the cluster?"""
    addr = ipaddress.ip_address(ip)

    def in_block(block: dict[str, Any]) -> bool:
        return addr in ipaddress.ip_network(block["cidr"]) and not any(
            addr in ipaddress.ip_network(e) for e in block.get("except", [])
        )

    for pol in policies:
        if "Egress" not in pol["spec"]["policyTypes"] or not selects(pol["spec"]["podSelector"], subject):
            continue
        for rule in pol["spec"].get("egress", []):
            peers = rule.get("to")
            if port_open(rule.get("ports"), port) and (
                not peers or any(in_block(p["ipBlock"]) for p in peers if "ipBlock" in p)
            ):
                return True
    return False


def _with_object_store(tmp_path: Path) -> list[dict[str, Any]]:
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    rel = Path(os.path.relpath(REPO / "k8s", overlay))
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "resources": [str(rel / "overlays" / "gpu-prod")],
                "components": [str(rel / "components" / "object-store")],
            }
        )
    )
    return kustomize_build(overlay)


def _pods(objs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    out = {}
    for o in objs:
        if o["kind"] in ("RayService", "RayJob"):
            for where, node_type, g in ray_groups(o):
                out[where] = pod_labels(g, node_type)
    out["another pod"] = {"app": "something-else"}
    return out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_pod_reaches_the_instance_metadata_address(overlay: str) -> None:
    policies = of_kind(overlay, "NetworkPolicy")
    for where, labels in _pods(list(render(overlay))).items():
        for port in (80, 443):
            assert not _ip_egress_allowed(policies, labels, METADATA, port), f"{where}: {METADATA}:{port}"


def test_with_an_object_store_only_checkpoint_readers_reach_the_metadata_address(tmp_path: Path) -> None:
    objs = _with_object_store(tmp_path)
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    for where, labels in _pods(objs).items():
        component, node_type = labels.get("raystack.io/component"), labels.get("ray.io/node-type")
        reader = component == "training" or (component == "serving" and node_type == "worker")
        assert _ip_egress_allowed(policies, labels, METADATA, 80) is reader, where
        if reader:
            assert _ip_egress_allowed(policies, labels, "52.216.0.1", 443), where  # the store (S3)
        assert not _ip_egress_allowed(policies, labels, METADATA, 443), where
    assert not _ip_egress_allowed(policies, _pods(objs)["another pod"], "52.216.0.1", 443)
    head = next(labels for w, labels in _pods(objs).items() if w.startswith("RayService") and w.endswith("head"))
    assert _ip_egress_allowed(policies, head, "10.0.0.1", 443)  # the API server, for the autoscaler


# --- keys in the environment ------------------------------------------------------------------


def test_the_engine_does_not_inherit_the_tenants_keys() -> None:
    """A worker pod gets every tenant key from its Secret (envFrom); the vLLM child process must
    not: its environment is readable by whatever the engine runs, and it needs none of them."""
    from serving.control.serve_config import build_serve_config
    from serving.replica.engine import EngineSpec, engine_environ

    cfg = load_config(REPO / "deployments" / "gpu-prod.yaml")
    key_envs = {t.key_env for t in cfg.auth.tenants if t.key_env}
    assert key_envs
    for app in [a for a in build_serve_config(cfg)["applications"] if "spec" in a["args"]]:
        spec = EngineSpec.model_validate(app["args"]["spec"])
        env = engine_environ({**dict.fromkeys(key_envs, "sk-secret"), "PATH": "/usr/bin"}, spec)
        assert not key_envs & set(env) and env["PATH"] == "/usr/bin", app["name"]


def test_the_engine_does_not_inherit_the_stores_credentials() -> None:
    """The replica fetches a version with the store's credentials; vLLM reads the verified local copy."""
    from serving.control.serve_config import build_serve_config
    from serving.replica.engine import EngineSpec, engine_environ

    app = build_serve_config(load_config(REPO / "deployments" / "gpu-prod.yaml"))["applications"][1]
    spec = EngineSpec.model_validate(app["args"]["spec"])
    creds = {"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "s", "AZURE_STORAGE_KEY": "k", "HF_TOKEN": "h"}
    env = engine_environ({**creds, "PATH": "/usr/bin", "HOME": "/root"}, spec)
    assert not set(creds) & set(env) and env["PATH"] == "/usr/bin" and env["HOME"] == "/root"


def test_a_key_from_a_secret_file_with_a_trailing_newline_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    from serving.config import AuthConfig
    from serving.gateway.admission.auth import Authenticator

    monkeypatch.setenv("RAYSTACK_TEST_KEY", "sk-from-file\n")
    auth = Authenticator(
        AuthConfig.model_validate({"mode": "keys", "tenants": [{"name": "t", "key_env": "RAYSTACK_TEST_KEY"}]})
    )
    assert auth.authenticate("Bearer sk-from-file").name == "t"


# --- draining -------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_serving_pods_drain_within_one_budget(overlay: str) -> None:
    """The stack config's shutdown budget holds on the pods: each serving worker sleeps notice_s
    in preStop (load balancers notice), and its termination grace covers that plus Serve's
    graceful shutdown (grace_s)."""
    sd = load_config(REPO / "deployments" / f"{_env_of(overlay)}.yaml").shutdown
    (rs,) = of_kind(overlay, "RayService")
    for where, node_type, g in ray_groups(rs):
        pod = g["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] >= sd.notice_s + sd.grace_s, where
        if node_type == "worker":
            (c,) = pod["containers"]
            assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", f"{sd.notice_s:g}"], where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_serving_workers_have_a_disruption_budget(overlay: str) -> None:
    (rs,) = of_kind(overlay, "RayService")
    pdbs = of_kind(overlay, "PodDisruptionBudget")
    for where, node_type, g in ray_groups(rs):
        covering = [p for p in pdbs if selects(p["spec"]["selector"], pod_labels(g, node_type))]
        if node_type == "worker":
            assert [p["spec"].get("maxUnavailable") for p in covering] == [1], where
        else:
            assert covering == [], f"{where}: a budget on the single head would block node drains"
