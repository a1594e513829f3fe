"""The promotion controller on Kubernetes, everything up to the API call: the step's patch is built
by render-k8s's own code, its serveConfigV2 passes Ray Serve's ServeDeploySchema, the RayService it
makes passes KubeRay's CRD, and the request the applier sends (a JSON merge patch of exactly that
RayService, with the pod's token) is checked on an in-process transport. No cluster here: the
call against a real API server is not exercised."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from serving.config import load_config
from serving.control.controller import with_live
from serving.control.k8s import for_k8s
from serving.control.k8s_apply import RayServiceApplier, patch_document, serve_config_v2
from serving.control.serve_config import CONTROLLER_APP
from tests.support.manifests import CrdValidator, find_crd_dir, kustomize_build

REPO = Path(__file__).resolve().parents[2]


def _step(env: str = "gpu-prod") -> tuple[Any, Any]:
    seed = for_k8s(load_config(REPO / "deployments" / f"{env}.yaml"))
    m = seed.models[0]
    live = with_live(seed, {m.name: [(m.live_version, 90), ("v9", 10)]})
    return seed, live


def test_a_step_is_a_valid_serve_config_and_rayservice() -> None:
    seed, live = _step()
    patch = patch_document(live, seed)
    config = yaml.safe_load(patch["spec"]["serveConfigV2"])  # ServeDeploySchema-checked when built
    names = [a["name"] for a in config["applications"]]
    assert f"{seed.models[0].name}--v9" in names and CONTROLLER_APP in names
    (rs,) = [o for o in kustomize_build(REPO / "k8s" / "overlays" / "gpu-prod") if o["kind"] == "RayService"]
    patched = copy.deepcopy(rs)
    patched["spec"].update(patch["spec"])  # what a JSON merge patch of spec.serveConfigV2 does
    assert CrdValidator(find_crd_dir(REPO)).validate(patched) == []
    # the controller app is the rendered overlay's own: KubeRay does not restart it for a step
    rendered = {a["name"]: a for a in yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]}
    assert {a["name"]: a for a in config["applications"]}[CONTROLLER_APP] == rendered[CONTROLLER_APP]


def test_the_rendered_overlay_is_the_seed_of_the_controllers_patches() -> None:
    seed, _ = _step()
    (rs,) = [o for o in kustomize_build(REPO / "k8s" / "overlays" / "gpu-prod") if o["kind"] == "RayService"]
    assert rs["spec"]["serveConfigV2"] == serve_config_v2(seed, seed)


class FakeApi:
    def __init__(self, current: str) -> None:
        self.current, self.calls = current, []  # type: list[tuple[str, str, dict[str, str], Any]]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.calls.append((request.method, request.url.path, dict(request.headers), body))
        if request.method == "GET":
            return httpx.Response(200, json={"spec": {"serveConfigV2": self.current}})
        self.current = body["spec"]["serveConfigV2"]
        return httpx.Response(200, json={"spec": {"serveConfigV2": self.current}})


@pytest.fixture
def sa_dir(tmp_path: Path) -> Path:
    (tmp_path / "token").write_text("pod-token\n")
    (tmp_path / "namespace").write_text("raystack")
    return tmp_path


def test_the_applier_patches_exactly_the_rayservice_and_only_on_change(sa_dir: Path) -> None:
    seed, live = _step()
    api = FakeApi(serve_config_v2(seed, seed))
    applier = RayServiceApplier(seed, local=None, sa_dir=sa_dir, transport=httpx.MockTransport(api))
    applier.apply(seed)  # what serves already: a GET, no patch
    assert [c[0] for c in api.calls] == ["GET"]
    applier.apply(live)
    method, path, headers, body = api.calls[-1]
    assert method == "PATCH" and path == "/apis/ray.io/v1/namespaces/raystack/rayservices/raystack"
    assert headers["authorization"] == "Bearer pod-token"
    assert headers["content-type"] == "application/merge-patch+json"
    assert body == patch_document(live, seed) and list(body) == ["spec"] and list(body["spec"]) == ["serveConfigV2"]
    applier.apply(seed)  # e.g. the controller's reconcile after a git re-apply: patched back
    assert api.calls[-1][0] == "PATCH" and api.current == serve_config_v2(seed, seed)


def test_an_edited_config_applied_by_the_operator_is_not_patched_back(sa_dir: Path) -> None:
    """The operator applied a re-rendered, edited config (gateway retries 2 -> 5) while a canary ran:
    its controller application's args differ from this controller's, so this one leaves the
    RayService as it is (Serve restarts the controller with the new config)."""
    seed, live = _step()
    edited = seed.model_copy(update={"gateway": seed.gateway.model_copy(update={"retries": 5})})
    api = FakeApi(serve_config_v2(edited, edited))
    applier = RayServiceApplier(seed, local=None, sa_dir=sa_dir, transport=httpx.MockTransport(api))
    with pytest.raises(RuntimeError, match="holds another stack config than this controller's"):
        applier.apply(live)
    assert [c[0] for c in api.calls] == ["GET"] and api.current == serve_config_v2(edited, edited)
    restarted = RayServiceApplier(edited, local=None, sa_dir=sa_dir, transport=httpx.MockTransport(api))
    restarted.apply(with_live(edited, {seed.models[0].name: [(seed.models[0].live_version, 90), ("v9", 10)]}))
    assert api.calls[-1][0] == "PATCH" and "retries: 5" in api.current


def test_a_refused_patch_is_an_error(sa_dir: Path) -> None:
    seed, live = _step()
    refuse = httpx.MockTransport(
        lambda r: httpx.Response(200, json={"spec": {}}) if r.method == "GET" else httpx.Response(403, text="forbidden")
    )
    with pytest.raises(RuntimeError, match="refused \\(403\\)"):
        RayServiceApplier(seed, local=None, sa_dir=sa_dir, transport=refuse).apply(live)
