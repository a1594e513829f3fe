"""Rules the CRD schemas do not encode, checked on the rendered overlays (no cluster):

- KubeRay's own validation (name lengths, upgrade strategies, autoscaler v2, SidecarMode, GCS FT);
- Kueue's rules for RayJobs, and that the job can be admitted by the ClusterQueue at all;
- security: non-root, no privilege escalation, no capabilities, read-only root filesystems, pinned
  images, no plain-text secrets, ClusterIP only, API keys from a Secret reference;
- network: default deny, and every port Ray, vLLM, NCCL and the gateway use is opened between the
  pods that need it and no further (the dashboard only to the KubeRay operator);
- storage, monitoring and cluster shape agree with the stack config.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from serving.config import load_config
from tests.support.manifests import find_kubectl, kustomize_build

REPO = Path(__file__).resolve().parents[2]
OVERLAYS_DIR = REPO / "k8s" / "overlays"
OVERLAYS = sorted(p.name for p in OVERLAYS_DIR.iterdir() if (p / "kustomization.yaml").is_file())
RAY_KINDS = ("RayService", "RayCluster", "RayJob")
NAMESPACE = "raystack"
CHECKPOINTS = "/mnt/checkpoints"
API_KEYS_SECRET = "raystack-api-keys"
TRAIN_ENTRYPOINT = (
    "python -m training.train --root /mnt/checkpoints --model adder --version v2 --base adder@v1 "
    "--data builtin:add --method full"
)
PORT_PARAMS = (
    "port",
    "node-manager-port",
    "object-manager-port",
    "runtime-env-agent-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "metrics-export-port",
)
DASHBOARD = 8265
OPERATOR = ({"app.kubernetes.io/name": "kuberay-operator"}, {"kubernetes.io/metadata.name": "kuberay-system"})
MONITORING_NS = {"kubernetes.io/metadata.name": "monitoring"}
OTHER_NS = {"kubernetes.io/metadata.name": "default"}
# KubeRay's default SidecarMode submitter container, which Kueue adds to the head pod set.
SIDECAR_SUBMITTER = {"cpu": 0.5, "memory": 256 * 2**20}

pytestmark = pytest.mark.skipif(find_kubectl() is None, reason="kubectl not found")  # test_k8s.py fails loudly


@functools.cache
def render(overlay: str) -> tuple[dict[str, Any], ...]:
    return tuple(kustomize_build(OVERLAYS_DIR / overlay))


def of_kind(overlay: str, *kinds: str) -> list[dict[str, Any]]:
    return [o for o in render(overlay) if o["kind"] in kinds]


def cluster_spec(obj: dict[str, Any]) -> dict[str, Any]:
    spec = obj["spec"]
    return {
        "RayService": lambda: spec["rayClusterConfig"],
        "RayJob": lambda: spec["rayClusterSpec"],
        "RayCluster": lambda: spec,
    }[obj["kind"]]()


def ray_groups(obj: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(where, node type, group spec) for the head and every worker group of a Ray object."""
    cs = cluster_spec(obj)
    name = f"{obj['kind']}/{obj['metadata']['name']}"
    yield f"{name} head", "head", cs["headGroupSpec"]
    for g in cs.get("workerGroupSpecs", []):
        yield f"{name} {g['groupName']}", "worker", g


def pod_labels(group: dict[str, Any], node_type: str) -> dict[str, str]:
    """The labels KubeRay's pods carry: the template's plus ray.io/node-type."""
    return {**group["template"].get("metadata", {}).get("labels", {}), "ray.io/node-type": node_type}


def quantity(v: Any) -> float:
    s = str(v)
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9}
    for u, f in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if s.endswith(u):
            return float(s[: -len(u)]) * f
    return float(s)


def all_ray_objects() -> list[tuple[str, dict[str, Any]]]:
    return [(ov, o) for ov in OVERLAYS for o in of_kind(ov, *RAY_KINDS)]


# --- KubeRay rules ----------------------------------------------------------------------------------

DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ray_object_names(overlay: str) -> None:
    for o in of_kind(overlay, *RAY_KINDS):
        name = o["metadata"]["name"]
        assert len(name) <= 47 and DNS1035.match(name), f"{o['kind']}/{name}: at most 47 chars, DNS-1035"
        for where, _, g in ray_groups(o):
            assert DNS1035.match(g.get("groupName", "head")), where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kuberay_cluster_rules(overlay: str) -> None:
    """What KubeRay's ValidateRayClusterSpec/ValidateRayServiceSpec would refuse."""
    for o in of_kind(overlay, *RAY_KINDS):
        cs = cluster_spec(o)
        assert cs["rayVersion"] == "2.60.0"
        autoscaling = cs.get("enableInTreeAutoscaling", False)
        ft = cs.get("gcsFaultToleranceOptions")
        for where, _, g in ray_groups(o):
            params = g.get("rayStartParams", {})
            assert "labels" not in params, where
            assert not (set(params) & {"num-cpus", "num-gpus", "memory", "resources"} and g.get("resources")), where
            if autoscaling and cs.get("autoscalerOptions", {}).get("version") == "v2":
                assert g["template"]["spec"].get("restartPolicy", "Never") == "Never", where
            if g is cs["headGroupSpec"]:
                env = {e["name"] for e in g["template"]["spec"]["containers"][0].get("env", [])}
                assert not ({"RAY_REDIS_ADDRESS", "REDIS_PASSWORD", "REDIS_USERNAME"} & env), where
                assert "redis-password" not in params and "redis-username" not in params, where
                if not ft:
                    assert "RAY_enable_autoscaler_v2" not in env, where
        if ft:
            assert ft["redisAddress"]
            assert "value" not in ft.get("redisPassword", {}), "the Redis password must come from a Secret"
            assert ft["redisPassword"]["valueFrom"]["secretKeyRef"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rayservice_upgrade_strategy(overlay: str) -> None:
    (rs,) = of_kind(overlay, "RayService")
    spec = rs["spec"]
    strategy = spec["upgradeStrategy"]
    assert strategy["type"] in ("NewCluster", "NewClusterWithIncrementalUpgrade", "None")
    assert spec.get("rayClusterDeletionDelaySeconds", 0) >= 0
    assert not spec["rayClusterConfig"]["headGroupSpec"].get("headService", {}).get("metadata", {}).get("name")
    if overlay.endswith("-incremental"):
        assert strategy["type"] == "NewClusterWithIncrementalUpgrade"
        opts = strategy["clusterUpgradeOptions"]
        assert spec["rayClusterConfig"]["enableInTreeAutoscaling"] is True, "required by KubeRay"
        assert opts["gatewayClassName"]
        assert 0 <= opts["stepSizePercent"] <= 100 and opts["intervalSeconds"] > 0
        assert 0 <= opts.get("maxSurgePercent", 100) <= 100
    else:
        assert strategy == {"type": "NewCluster"}, "blue/green: a cluster change builds a new cluster"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rayservice_autoscaling(overlay: str) -> None:
    (rs,) = of_kind(overlay, "RayService")
    cs = rs["spec"]["rayClusterConfig"]
    assert cs["enableInTreeAutoscaling"] is True
    opts = cs["autoscalerOptions"]
    assert opts["version"] == "v2" and opts["resources"]["limits"] and opts["resources"]["requests"]
    for where, _, g in ray_groups(rs):
        if g is not cs["headGroupSpec"]:
            assert g["minReplicas"] <= g.get("replicas", g["minReplicas"]) <= g["maxReplicas"], where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_rayjob_entrypoint_is_a_valid_training_command(overlay: str) -> None:
    """The RayJob runs the same command as a laptop: its arguments parse with the job's own parser."""
    from training.train import parser

    (job,) = of_kind(overlay, "RayJob")
    words = job["spec"]["entrypoint"].split()
    assert words[:3] == ["python", "-m", "training.train"]
    args = parser().parse_args(words[3:])
    assert args.root == CHECKPOINTS and args.method == "full" and args.base and args.data


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rayjob_rules(overlay: str) -> None:
    (job,) = of_kind(overlay, "RayJob")
    spec = job["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    assert spec["ttlSecondsAfterFinished"] > 0 and spec["backoffLimit"] >= 0
    assert spec["activeDeadlineSeconds"] > 0
    assert spec["submissionMode"] in ("K8sJobMode", "HTTPMode", "SidecarMode")
    if spec["submissionMode"] == "SidecarMode":
        assert "submitterPodTemplate" not in spec and "submitterConfig" not in spec
        assert spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"].get("restartPolicy", "Never") == "Never"
    if overlay == "cpu-dev":
        assert spec["entrypoint"] == TRAIN_ENTRYPOINT
    if overlay.startswith("gpu-prod"):
        assert "--base llama-8b@v1 " in spec["entrypoint"]


# --- Kueue ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rayjob_is_admissible_by_kueue(overlay: str) -> None:
    """Kueue's RayJob webhook rules, and that the ClusterQueue can admit the job at all."""
    (job,) = of_kind(overlay, "RayJob")
    spec, labels = job["spec"], job["metadata"]["labels"]
    cs = spec["rayClusterSpec"]
    assert "clusterSelector" not in spec, "a Kueue-managed job must not use an existing cluster"
    assert spec["shutdownAfterJobFinishes"] is True, "Kueue: the cluster must go when the job ends"
    assert not cs.get("enableInTreeAutoscaling"), "Kueue reserves quota for the whole cluster: no autoscaler"
    submitter_pods = 1 if spec["submissionMode"] == "K8sJobMode" else 0
    assert 1 + len(cs["workerGroupSpecs"]) + submitter_pods <= 8, "at most 8 pod sets per workload"
    assert all(g["groupName"] != "head" for g in cs["workerGroupSpecs"])

    (lq,) = [q for q in of_kind(overlay, "LocalQueue") if q["metadata"]["name"] == labels["kueue.x-k8s.io/queue-name"]]
    assert lq["metadata"]["namespace"] == job["metadata"]["namespace"]
    (cq,) = [q for q in of_kind(overlay, "ClusterQueue") if q["metadata"]["name"] == lq["spec"]["clusterQueue"]]
    ns_labels = {"kubernetes.io/metadata.name": job["metadata"]["namespace"]}
    assert selects(cq["spec"]["namespaceSelector"], ns_labels), "the ClusterQueue must admit the job's namespace"
    wpcs = {w["metadata"]["name"]: w["value"] for w in of_kind(overlay, "WorkloadPriorityClass")}
    assert labels["kueue.x-k8s.io/priority-class"] in wpcs
    assert wpcs["raystack-serving"] > wpcs["raystack-training"]
    flavors = {f["metadata"]["name"]: f["spec"] for f in of_kind(overlay, "ResourceFlavor")}

    quota: dict[str, float] = {}
    for rg in cq["spec"]["resourceGroups"]:
        for fl in rg["flavors"]:
            assert fl["name"] in flavors, f"ClusterQueue names unknown flavor {fl['name']}"
            for r in fl["resources"]:
                quota[r["name"]] = quota.get(r["name"], 0) + quantity(r["nominalQuota"])
    need: dict[str, float] = dict(SIDECAR_SUBMITTER) if spec["submissionMode"] == "SidecarMode" else {}
    for where, _, g in ray_groups(job):
        count = 1 if g is cs["headGroupSpec"] else g["replicas"] * g.get("numOfHosts", 1)
        for c in g["template"]["spec"]["containers"]:
            for res, v in c["resources"]["requests"].items():
                assert res in quota, f"{where}: requests {res}, which the ClusterQueue does not cover"
                need[res] = need.get(res, 0) + count * quantity(v)
        if "nvidia.com/gpu" in str(g["template"]["spec"]["containers"]):
            gpu = flavors["raystack-gpu"]
            for k, v in gpu.get("nodeLabels", {}).items():
                assert g["template"]["spec"].get("nodeSelector", {}).get(k, v) == v, where
    for res, amount in need.items():
        assert amount <= quota[res], f"the job needs {res}={amount}, more than the quota {quota[res]}"


# --- security ---------------------------------------------------------------------------------------


def pod_specs(overlay: str) -> Iterator[tuple[str, dict[str, Any]]]:
    for o in of_kind(overlay, *RAY_KINDS):
        for where, _, g in ray_groups(o):
            yield where, g["template"]["spec"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_containers_are_locked_down(overlay: str) -> None:
    for where, pod in pod_specs(overlay):
        psc = pod.get("securityContext", {})
        assert psc.get("seccompProfile", {}).get("type") == "RuntimeDefault", where
        assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), where
        assert not any("hostPath" in v for v in pod.get("volumes", [])), where
        tmp = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        for c in pod["containers"]:
            sc = c["securityContext"]
            non_root = sc.get("runAsNonRoot", psc.get("runAsNonRoot"))
            uid = sc.get("runAsUser", psc.get("runAsUser"))
            assert non_root is True and uid not in (None, 0), f"{where}/{c['name']}: non-root"
            assert sc["allowPrivilegeEscalation"] is False and not sc.get("privileged"), where
            assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add"), where
            assert sc["readOnlyRootFilesystem"] is True, where
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert mounts.get("/tmp") in tmp, f"{where}: Ray needs a writable /tmp (emptyDir)"
            assert all(not p.get("hostPort") for p in c.get("ports", [])), where
            res = c["resources"]
            for key in ("cpu", "memory"):
                assert key in res["requests"] and key in res["limits"], f"{where}: {key} requests and limits"
            if "nvidia.com/gpu" in res["limits"]:
                assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"], where
                assert pod["nodeSelector"].get("raystack.io/node-pool") == "gpu", f"{where}: GPU node pool"
                assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    for o in of_kind(overlay, "RayService"):
        a = cluster_spec(o)["autoscalerOptions"]
        sc = a["securityContext"]
        assert sc["runAsNonRoot"] and sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
        assert sc["readOnlyRootFilesystem"] and {m["mountPath"] for m in a["volumeMounts"]} >= {"/tmp"}


IMAGE = re.compile(r"^(?P<repo>[a-z0-9./_-]+):(?P<tag>[A-Za-z0-9._-]+)$")


def values_at(obj: Any, key: str, kind: type) -> Iterator[Any]:
    """Every value of type ``kind`` stored under ``key`` anywhere in a nested manifest."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == key and isinstance(v, kind):
                yield v
            else:
                yield from values_at(v, key, kind)
    elif isinstance(obj, list):
        for v in obj:
            yield from values_at(v, key, kind)


def images(obj: Any) -> Iterator[str]:
    return values_at(obj, "image", str)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_are_pinned(overlay: str) -> None:
    found = set(images(list(render(overlay))))
    assert found
    for image in found:
        m = IMAGE.match(image.split("@")[0])
        assert m, f"{image}: no tag"
        assert m["tag"] != "latest" and m["repo"] == "ghcr.io/raystack/raystack-llm", image
        assert m["tag"].startswith("0.1.0-ray2.60.0"), image


def test_dockerfile_pins_its_base_images_and_runs_non_root() -> None:
    text = (REPO / "Dockerfile").read_text()
    froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert "rayproject/ray-llm:2.60.0-py311-cu128" in froms
    for image in froms:
        assert IMAGE.match(image.split("@")[0]) and not image.endswith(":latest"), image
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert len(users) == len(froms) and all(u.split(":")[0] not in ("0", "root") for u in users)
    assert not re.search(r"^(ARG|ENV)\s+\S*(PASSWORD|SECRET|TOKEN|API_KEY)", text, re.M | re.I)
    assert "pip install --no-cache-dir" in text


SECRET_NAME = re.compile(r"(^|_)(PASSWORD|PASSWD|SECRET|TOKEN|KEY|APIKEY|CREDENTIALS?)(_|$)", re.I)
SECRET_VALUE = re.compile(r"(sk-[A-Za-z0-9_-]{16,}|AKIA[0-9A-Z]{16}|-----BEGIN|[A-Za-z0-9+/_-]{40,}={0,2}$)")


def envs(obj: Any) -> Iterator[dict[str, Any]]:
    for env in values_at(obj, "env", list):
        yield from env


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_plain_text_secrets_in_rendered_manifests(overlay: str) -> None:
    objs = render(overlay)
    assert not [o for o in objs if o["kind"] == "Secret"], "Secrets are created out of band, never committed"
    for e in envs(list(objs)):
        if "value" in e:
            assert not SECRET_NAME.search(e["name"]), f"env {e['name']} must come from a secretKeyRef"
            assert not SECRET_VALUE.search(str(e["value"])), f"env {e['name']} looks like a secret"


LITERAL_KEY = re.compile(r"\bsk-[A-Za-z0-9_-]{16,}|AKIA[0-9A-Z]{16}|BEGIN [A-Z ]*PRIVATE KEY")


def test_no_secrets_committed_under_k8s_or_deployments() -> None:
    for path in [*REPO.glob("k8s/**/*.yaml"), *REPO.glob("deployments/*.yaml")]:
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "Secret":
                assert not (doc.get("data") or doc.get("stringData")), f"{path}: literal Secret"
        assert not LITERAL_KEY.search(path.read_text()), f"{path}: looks like a committed key"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_api_keys_come_from_a_secret_reference(overlay: str) -> None:
    (rs,) = of_kind(overlay, "RayService")
    for where, node_type, g in ray_groups(rs):
        c = g["template"]["spec"]["containers"][0]
        refs = [e["secretRef"] for e in c.get("envFrom", []) if "secretRef" in e]
        if node_type == "head":  # num-cpus 0: no gateway replica ever runs there
            assert not refs, f"{where}: the head needs no API keys"
        else:
            assert {"name": API_KEYS_SECRET, "optional": True} in refs, f"{where}: gateway replicas need the keys"
    env = _base_env_config(overlay)
    tenants = env.auth.tenants
    assert env.auth.mode == "keys" and tenants
    for t in tenants:
        assert t.key_env and re.fullmatch(r"[A-Z_][A-Z0-9_]*", t.key_env), t.name


def _base_env_config(overlay: str) -> Any:
    name = overlay if (REPO / "deployments" / f"{overlay}.yaml").is_file() else "gpu-prod"
    return load_config(REPO / "deployments" / f"{name}.yaml")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_cluster_ip_services(overlay: str) -> None:
    objs = render(overlay)
    assert not [o for o in objs if o["kind"] in ("Ingress", "Route", "Gateway", "HTTPRoute")]
    for s in (o for o in objs if o["kind"] == "Service"):
        assert s["spec"].get("type", "ClusterIP") == "ClusterIP", s["metadata"]["name"]
    for o in of_kind(overlay, *RAY_KINDS):
        head = cluster_spec(o)["headGroupSpec"]
        assert head["serviceType"] == "ClusterIP" and head.get("enableIngress") is False
    (rs,) = of_kind(overlay, "RayService")
    serve = rs["spec"]["serveService"]["spec"]
    assert serve["type"] == "ClusterIP"
    port = gateway_port(yaml.safe_load(rs["spec"]["serveConfigV2"]))
    assert [p["port"] for p in serve["ports"]] == [port] == [p["targetPort"] for p in serve["ports"]]
    assert rs["spec"]["excludeHeadPodFromServeSvc"] is True


# --- network ----------------------------------------------------------------------------------------


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        has, val = e["key"] in labels, labels.get(e["key"])
        ok = {
            "In": has and val in e.get("values", []),
            "NotIn": not has or val not in e.get("values", []),
            "Exists": has,
            "DoesNotExist": not has,
        }[e["operator"]]
        if not ok:
            return False
    return True


def port_open(ports: list[dict[str, Any]] | None, port: int) -> bool:
    if not ports:
        return True
    return any(
        p.get("protocol", "TCP") == "TCP" and "port" in p and p["port"] <= port <= p.get("endPort", p["port"])
        for p in ports
    )


def peer_matches(peer: dict[str, Any], labels: dict[str, str], ns: dict[str, str]) -> bool:
    if "ipBlock" in peer:
        return False
    same_ns = ns.get("kubernetes.io/metadata.name") == NAMESPACE
    ns_ok = selects(peer["namespaceSelector"], ns) if "namespaceSelector" in peer else same_ns
    return ns_ok and ("podSelector" not in peer or selects(peer["podSelector"], labels))


def allowed(
    policies: list[dict[str, Any]],
    direction: str,
    subject: dict[str, str],
    peer: dict[str, str],
    peer_ns: dict[str, str],
    port: int,
) -> bool:
    """Is traffic on ``port`` allowed ``direction`` (Ingress: peer -> subject; Egress: subject -> peer)?"""
    key, peers_key = direction.lower(), "from" if direction == "Ingress" else "to"
    selected = [
        p for p in policies if direction in p["spec"]["policyTypes"] and selects(p["spec"]["podSelector"], subject)
    ]
    for pol in selected:
        for rule in pol["spec"].get(key, []):
            peers = rule.get(peers_key)
            if port_open(rule.get("ports"), port) and (not peers or any(peer_matches(x, peer, peer_ns) for x in peers)):
                return True
    return False


def flow(
    policies: list[dict[str, Any]],
    src: dict[str, str],
    dst: dict[str, str],
    port: int,
    src_ns: dict[str, str] | None = None,
) -> bool:
    """Both ends agree: the source may send (egress) and the destination may receive (ingress)."""
    own = {"kubernetes.io/metadata.name": NAMESPACE}
    src_ns = src_ns or own
    ingress = allowed(policies, "Ingress", dst, src, src_ns, port)
    if src_ns != own:  # a pod in another namespace: its egress is not ours to check
        return ingress
    return ingress and allowed(policies, "Egress", src, dst, own, port)


def required_ports(obj: dict[str, Any]) -> Iterator[tuple[str, str, int]]:
    """(where, what, port) for every port a Ray pod listens on for its cluster peers."""
    for where, _, g in ray_groups(obj):
        params = g.get("rayStartParams", {})
        for p in PORT_PARAMS:
            if p in params:
                yield where, p, int(params[p])
        lo, hi = int(params["min-worker-port"]), int(params["max-worker-port"])
        yield from ((where, "worker port", x) for x in (lo, (lo + hi) // 2, hi))
        for s in g["template"]["spec"]["securityContext"].get("sysctls", []):
            if s["name"] == "net.ipv4.ip_local_port_range":  # vLLM servers, NCCL/Gloo, torch store
                lo, hi = map(int, s["value"].split())
                yield from ((where, "ephemeral (vLLM/NCCL)", x) for x in (lo, (lo + hi) // 2, hi))
    if obj["kind"] == "RayService":
        serve_config = yaml.safe_load(obj["spec"]["serveConfigV2"])
        for what, port in (
            ("gateway", gateway_port(serve_config)),
            ("Serve HTTP", serve_config["http_options"]["port"]),
        ):
            yield from ((w, what, port) for w, _, _ in ray_groups(obj))


def gateway_port(serve_config: dict[str, Any]) -> int:
    """Where the OpenAI API answers: the gateway replicas' own listener, else Serve's proxy."""
    (gw,) = [a for a in serve_config["applications"] if a["name"] == "gateway"]
    config = gw["args"]["config"]
    return int(config["port"]) if config["ingress"] == "listener" else int(serve_config["http_options"]["port"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_default_deny(overlay: str) -> None:
    deny = [
        p
        for p in of_kind(overlay, "NetworkPolicy")
        if p["spec"]["podSelector"] == {}
        and set(p["spec"]["policyTypes"]) == {"Ingress", "Egress"}
        and not p["spec"].get("ingress")
        and not p["spec"].get("egress")
    ]
    assert deny, "a default-deny NetworkPolicy for all pods, both directions"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_ray_port_is_open_inside_its_own_cluster(overlay: str) -> None:
    policies = of_kind(overlay, "NetworkPolicy")
    for obj in of_kind(overlay, *RAY_KINDS):
        groups = [(pod_labels(g, t), where) for where, t, g in ray_groups(obj)]
        by_where = dict((w, lab) for lab, w in groups)
        for where, what, port in required_ports(obj):
            for src, src_where in groups:
                assert flow(policies, src, by_where[where], port), f"{src_where} -> {where}: {what} {port} blocked"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_clusters_are_isolated_and_the_dashboard_is_internal(overlay: str) -> None:
    policies = of_kind(overlay, "NetworkPolicy")
    (rs,) = of_kind(overlay, "RayService")
    (job,) = of_kind(overlay, "RayJob")
    serving = {t: pod_labels(g, t) for _, t, g in ray_groups(rs)}
    training = {t: pod_labels(g, t) for _, t, g in ray_groups(job)}
    stranger = {"app": "something-else"}
    for head in (serving["head"], training["head"]):
        # The dashboard / job API: the KubeRay operator only; not workers, not Prometheus, nobody else.
        assert flow(policies, OPERATOR[0], head, DASHBOARD, src_ns=OPERATOR[1])
        assert not flow(policies, OPERATOR[0], head, DASHBOARD, src_ns=OTHER_NS)
        for src in (serving["worker"], training["worker"], stranger):
            assert not flow(policies, src, head, DASHBOARD), f"{src} reaches the dashboard"
        assert not flow(policies, stranger, head, DASHBOARD, src_ns=MONITORING_NS)
        assert not flow(policies, stranger, head, 10001, src_ns=OTHER_NS), "Ray client port must stay closed"
    for port in (6379, 6380, 10002, 45000, 52365):  # no cross-talk between serving and training
        assert not flow(policies, training["worker"], serving["head"], port)
        assert not flow(policies, serving["worker"], training["worker"], port)
        assert not flow(policies, stranger, serving["worker"], port, src_ns=OTHER_NS)
    # The gateway answers in-cluster clients; training pods serve nothing.
    assert flow(policies, stranger, serving["worker"], 8000, src_ns=OTHER_NS)
    assert not flow(policies, stranger, training["worker"], 8000, src_ns=OTHER_NS)
    # Prometheus scrapes every Ray pod's metrics port and the head's autoscaler/dashboard metrics.
    for labels in (*serving.values(), *training.values()):
        assert flow(policies, stranger, labels, 8080, src_ns=MONITORING_NS)
    assert flow(policies, stranger, serving["head"], 44217, src_ns=MONITORING_NS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_policy_opens_all_ports_to_everyone(overlay: str) -> None:
    for pol in of_kind(overlay, "NetworkPolicy"):
        for rule in pol["spec"].get("ingress", []):
            assert rule.get("ports"), f"{pol['metadata']['name']}: an ingress rule without ports"
            assert rule.get("from"), f"{pol['metadata']['name']}: an ingress rule from anywhere"


# --- storage, monitoring, cluster shape -------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_training_and_serving_share_the_checkpoint_store(overlay: str) -> None:
    claims: dict[str, set[str]] = {"RayService": set(), "RayJob": set()}
    for o in of_kind(overlay, "RayService", "RayJob"):
        for where, node_type, g in ray_groups(o):
            if o["kind"] == "RayService" and node_type == "head":
                continue  # the serving head runs no engines
            pod = g["template"]["spec"]
            vols = {v["name"]: v for v in pod["volumes"]}
            (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == CHECKPOINTS]
            claims[o["kind"]].add(vols[mount["name"]]["persistentVolumeClaim"]["claimName"])
            # the promotion controller's group writes its record (.control/) into the store
            read_only = o["kind"] == "RayService" and g.get("groupName") != "promotion"
            assert mount.get("readOnly", False) is read_only, f"{where}: serving reads, training writes"
    assert len(claims["RayService"]) == 1 and claims["RayService"] == claims["RayJob"]
    (pvc,) = [p for p in of_kind(overlay, "PersistentVolumeClaim") if p["metadata"]["name"] in claims["RayJob"]]
    assert pvc["spec"]["accessModes"] == (["ReadWriteOnce"] if overlay == "cpu-dev" else ["ReadWriteMany"])
    cfg = _base_env_config(overlay)
    assert cfg.checkpoint_root == CHECKPOINTS
    (job,) = of_kind(overlay, "RayJob")
    assert job["spec"]["entrypoint"].split("--root ")[1].split()[0] == CHECKPOINTS


def _known_metrics() -> set[str]:
    """Prometheus names the stack exports: the issue's list plus serving/metrics.py's own."""
    names = {
        "raystack_requests_total",
        "raystack_time_to_first_token_seconds",
        "raystack_inter_token_latency_seconds",
        "raystack_request_latency_seconds",
        "raystack_prompt_tokens_total",
        "raystack_completion_tokens_total",
        "raystack_in_flight_requests",
        "raystack_rate_limited_total",
        "raystack_retries_total",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "ray_serve_deployment_replica_healthy",
    }
    src = REPO / "serving" / "metrics.py"
    if src.is_file():
        for kind, name in re.findall(r"m\.(Counter|Gauge|Histogram)\(\s*\"(\w+)\"", src.read_text()):
            names.add(name + "_total" if kind == "Counter" else name)
    return names


def test_grafana_dashboard() -> None:
    (cm,) = [o for o in of_kind("gpu-prod", "ConfigMap") if "grafana_dashboard" in o["metadata"].get("labels", {})]
    dash = json.loads(next(iter(cm["data"].values())))
    titles = " | ".join(p["title"] for p in dash["panels"]).lower()
    for topic in ("ttft p50 / p99", "tokens/s", "error rate", "queue depth", "kv-cache", "replicas"):
        assert topic in titles, topic
    known = _known_metrics()
    for panel in dash["panels"]:
        assert panel["targets"], panel["title"]
        for t in panel["targets"]:
            expr = t["expr"]
            assert expr.count("(") == expr.count(")"), expr
            used = set(re.findall(r"(?:raystack|ray_serve)_[a-z_]+|vllm:[a-z_]+", expr))
            for name in used:
                base = re.sub(r"_bucket$", "", name)
                assert base in known or base + "_total" in known or name in known, f"{panel['title']}: {name}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_podmonitors_scrape_named_ports_that_exist(overlay: str) -> None:
    monitors = of_kind(overlay, "PodMonitor")
    assert monitors and all(m["apiVersion"] == "monitoring.coreos.com/v1" for m in monitors)
    pods = [
        (pod_labels(g, t), g["template"]["spec"]) for o in of_kind(overlay, *RAY_KINDS) for _, t, g in ray_groups(o)
    ]
    for m in monitors:
        matched = [spec for labels, spec in pods if selects(m["spec"]["selector"], labels)]
        assert matched, m["metadata"]["name"]
        for ep in m["spec"]["podMetricsEndpoints"]:
            for spec in matched:
                names = {p.get("name") for c in spec["containers"] for p in c.get("ports", [])}
                assert ep["port"] in names, f"{m['metadata']['name']}: no port {ep['port']}"


def _pod_capacity(group: dict[str, Any]) -> dict[str, float]:
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    params = group.get("rayStartParams", {})
    cpu = float(params.get("num-cpus", quantity(limits["cpu"])))
    return {"CPU": cpu, "GPU": float(limits.get("nvidia.com/gpu", 0))}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_serve_deployment_fits_a_worker_group(overlay: str) -> None:
    """A replica's placement group (STRICT_PACK: all bundles on one node) must fit one pod."""
    (rs,) = of_kind(overlay, "RayService")
    groups = [(g["groupName"], _pod_capacity(g)) for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]]
    serve = yaml.safe_load(rs["spec"]["serveConfigV2"])
    for app in serve["applications"]:
        for d in app["deployments"]:
            bundles = d.get("placement_group_bundles") or [
                {"CPU": d["ray_actor_options"].get("num_cpus", 1), "GPU": d["ray_actor_options"].get("num_gpus", 0)}
            ]
            need = {r: sum(float(b.get(r, 0)) for b in bundles) for r in ("CPU", "GPU")}
            fits = [n for n, cap in groups if all(need[r] <= cap[r] for r in need)]
            assert fits, f"{app['name']}/{d['name']} needs {need}; no worker group holds it"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_optional_components_open_only_what_they_need(overlay: str) -> None:
    policies = of_kind(overlay, "NetworkPolicy")
    (rs,) = of_kind(overlay, "RayService")
    serving = {t: pod_labels(g, t) for _, t, g in ray_groups(rs)}
    redis, redis_ns = {"app": "redis"}, {"kubernetes.io/metadata.name": "raystack-redis"}
    ft = "gcsFaultToleranceOptions" in rs["spec"]["rayClusterConfig"]
    assert allowed(policies, "Egress", serving["head"], redis, redis_ns, 6379) is ft
    cleanup = {**serving["head"], "ray.io/node-type": "redis-cleanup"}  # KubeRay's Redis clean-up Job
    assert allowed(policies, "Egress", cleanup, redis, redis_ns, 6379) is ft
    assert not allowed(policies, "Egress", serving["worker"], redis, redis_ns, 6379)  # engines, gateway
    dataplane = {"gateway.networking.k8s.io/gateway-name": "raystack"}
    incremental = rs["spec"]["upgradeStrategy"]["type"] == "NewClusterWithIncrementalUpgrade"
    assert flow(policies, dataplane, serving["worker"], 8000) is incremental
    assert not flow(policies, dataplane, serving["head"], DASHBOARD)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_promotion_controller_is_placed_on_the_promotion_pod(overlay: str) -> None:
    """The promotion pod holds a Kubernetes API token and write access to the store: it offers Ray
    no CPU and no GPU, so every other Serve replica (gateways parse untrusted input) needs a
    resource it does not have; the controller asks for the group's own resource; the gateway's
    zero-CPU actors go to the head."""
    from serving.gateway.admission.quota import ON_HEAD

    (rs,) = of_kind(overlay, "RayService")
    (promotion,) = [g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == "promotion"]
    assert _pod_capacity(promotion) == {"CPU": 0.0, "GPU": 0.0}
    serve = yaml.safe_load(rs["spec"]["serveConfigV2"])
    for app in serve["applications"]:
        for d in app["deployments"]:
            options = d.get("ray_actor_options", {})
            if app["name"] == "promotion-controller":
                assert options == {"num_cpus": 0, "resources": {"raystack-promotion": 1}}
                continue
            bundles = d.get("placement_group_bundles") or [
                {"CPU": options.get("num_cpus", 1), "GPU": options.get("num_gpus", 0)}
            ]
            need = sum(float(b.get("CPU", 0)) + float(b.get("GPU", 0)) for b in bundles)
            assert need > 0, f"{app['name']}/{d['name']} could be placed on the promotion pod"
    assert ON_HEAD == {"node:__internal_head__": 0.001}  # Ray's own head-node resource
