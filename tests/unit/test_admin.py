"""The gateway's admin routes (``GET /admin/promotions[/{model}]``) in-process: the real gateway
app over a promotion record written by :class:`ControlStore` in a temporary store."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import fsspec
import httpx
import pytest
from fsspec.implementations.local import LocalFileSystem

from loadtests.relay import OneReplica
from serving.config import GatewayConfig, parse_config
from serving.control.serve_config import GATEWAY_APP, admin_access, build_serve_config, routing_user_config
from serving.gateway.admin import AdminAccess
from serving.gateway.admission.auth import hash_key
from serving.gateway.api import create_api
from serving.gateway.core import GatewayCore
from serving.record import ControlStore, PromotionRecord, StepRecord

ADMIN, TENANT = "sk-admin-0123456789", "sk-tenant-0123456789"


def _stack(root: Path, admin: dict[str, Any] | None = None, auth: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "name": "t",
        "checkpoint_root": str(root),
        "auth": auth or {"mode": "keys", "tenants": [{"name": "a", "key_hashes": [hash_key(TENANT)]}]},
        "controller": admin if admin is not None else {"admin_key_hashes": [hash_key(ADMIN)]},
        "models": [
            {"name": "calc", "versions": [{"version": "v1"}]},
            {"name": "other", "versions": [{"version": "v1"}]},
        ],
    }


def _record(store: ControlStore) -> None:
    """calc: v2 at its 50 % step (v1 before it was promoted from v0); other: as written."""
    store.set_live("calc", [("v1", 50), ("v2", 50)])
    store.set_live("other", [("v1", 100)])
    done = PromotionRecord(
        id="p1", model="calc", version="v1", previous="v0", source="manual", status="promoted",
        created_at=10.0, updated_at=20.0, reason="every step passed",
        steps=[StepRecord(at=20.0, phase="promoted", weights={"v1": 100})],
    )  # fmt: skip
    active = PromotionRecord(
        id="p2", model="calc", version="v2", previous="v1", source="auto", status="stepping", step_index=1,
        created_at=30.0, updated_at=40.0,
        steps=[
            StepRecord(at=31.0, phase="step", weights={"v1": 90, "v2": 10}, figures={"new_error_rate": 0.0}),
            StepRecord(at=40.0, phase="step", weights={"v1": 50, "v2": 50}, figures={"new_ttft_p95": 0.12}),
        ],
    )  # fmt: skip
    store.save(done)
    store.save(active)
    active.updated_at = 40.0  # save() stamps the time of writing


@contextlib.asynccontextmanager
async def _gateway(stack: dict[str, Any], access: AdminAccess | None) -> AsyncIterator[httpx.AsyncClient]:
    core = GatewayCore(GatewayConfig(), OneReplica("http://unused"), replica_id="gw-1")
    core.reconfigure(routing_user_config(parse_config(stack)))
    transport = httpx.ASGITransport(app=create_api(core, set_request_id_header=True, admin=access))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            yield client
    finally:
        await core.aclose()


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_an_admin_key_reads_live_versions_the_active_promotion_and_history(tmp_path: Path) -> None:
    stack = _stack(tmp_path)
    _record(ControlStore(str(tmp_path), "t"))
    async with _gateway(stack, admin_access(parse_config(stack), None)) as gw:
        listed = await gw.get("/admin/promotions", headers=_bearer(ADMIN))
        one = await gw.get("/admin/promotions/calc", headers={"x-api-key": ADMIN})
    assert listed.status_code == 200, listed.text
    data = {s["model"]: s for s in listed.json()["data"]}
    assert set(data) == {"calc", "other"}
    calc = data["calc"]
    assert calc["live"] == [{"version": "v1", "weight": 50}, {"version": "v2", "weight": 50}]
    active = calc["active"]
    assert (active["version"], active["status"], active["step_index"], active["phase"]) == ("v2", "stepping", 1, "step")
    assert active["weights"] == {"v1": 50, "v2": 50} and active["figures"] == {"new_ttft_p95": 0.12}
    assert [h["id"] for h in calc["history"]] == ["p2"] and "steps" not in active  # the list: the newest only
    assert data["other"] == {"object": "promotion.status", "model": "other", "live": [{"version": "v1", "weight": 100}],
                             "active": None, "history": []}  # fmt: skip
    assert one.status_code == 200, one.text
    body = one.json()
    assert [h["id"] for h in body["history"]] == ["p2", "p1"]  # newest first, each with its steps
    assert [s["weights"] for s in body["history"][0]["steps"]] == [{"v1": 90, "v2": 10}, {"v1": 50, "v2": 50}]
    assert body["history"][1]["reason"] == "every step passed"


async def test_a_tenant_key_gets_403_and_no_or_a_wrong_key_401(tmp_path: Path) -> None:
    stack = _stack(tmp_path)
    async with _gateway(stack, admin_access(parse_config(stack), None)) as gw:
        tenant = await gw.get("/admin/promotions", headers=_bearer(TENANT))
        tenant_x = await gw.get("/admin/promotions/calc", headers={"x-api-key": TENANT})
        none = await gw.get("/admin/promotions")
        wrong = await gw.get("/admin/promotions", headers=_bearer("sk-nobody"))
    for r in (tenant, tenant_x):
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", r.text
    for r in (none, wrong):
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    assert set(wrong.json()["error"]) == {"message", "type", "param", "code"} and "x-request-id" in wrong.headers


async def test_an_admin_key_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYSTACK_ADMIN_KEY", ADMIN + "\n")  # as a Secret made from a file
    stack = _stack(tmp_path, admin={"admin_key_env": "RAYSTACK_ADMIN_KEY"})
    _record(ControlStore(str(tmp_path), "t"))
    async with _gateway(stack, admin_access(parse_config(stack), None)) as gw:
        ok = await gw.get("/admin/promotions/other", headers=_bearer(ADMIN))
        unknown = await gw.get("/admin/promotions/nope", headers=_bearer(ADMIN))
    assert ok.status_code == 200 and ok.json()["live"] == [{"version": "v1", "weight": 100}]
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("how", ["admin_env_tenant_env", "admin_env_tenant_hash", "admin_hash_tenant_env"])
def test_an_admin_key_that_is_also_a_tenants_is_refused_at_start(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The config sees names and hashes only: one value under two variables, or a variable whose
    key a hash of the other side verifies, is found when the gateway reads the keys, whichever
    comes first (Serve builds the app, then applies the tenant list), and the message names the
    tenant, never the key."""
    monkeypatch.setenv("RAYSTACK_ADMIN_KEY", TENANT)
    monkeypatch.setenv("TEAM_A_KEY", TENANT + "\n")
    admin = (
        {"admin_key_hashes": [hash_key(TENANT)]}
        if how == "admin_hash_tenant_env"
        else {"admin_key_env": "RAYSTACK_ADMIN_KEY"}
    )
    tenant = {
        "name": "a",
        **({"key_hashes": [hash_key(TENANT)]} if how == "admin_env_tenant_hash" else {"key_env": "TEAM_A_KEY"}),
    }
    stack = _stack(tmp_path, admin=admin, auth={"mode": "keys", "tenants": [tenant]})
    access, user_config = admin_access(parse_config(stack), None), routing_user_config(parse_config(stack))
    # the tenant list first (as in scripts and tests), then the app
    core = GatewayCore(GatewayConfig(), OneReplica("http://unused"))
    core.reconfigure(user_config)
    with pytest.raises(ValueError, match="the admin key .* is also the API key of tenant 'a'") as exc:
        create_api(core, admin=access)
    assert TENANT not in str(exc.value)
    # the app first (the Serve deployment), then the tenant list: refused, the open table kept
    core = GatewayCore(GatewayConfig(), OneReplica("http://unused"))
    create_api(core, admin=access)
    with pytest.raises(ValueError, match="the admin key .* is also the API key of tenant 'a'"):
        core.reconfigure(user_config)
    assert core.auth.open and not core.routes.models


@pytest.mark.parametrize("auth", [None, {"mode": "open"}])
async def test_without_an_admin_key_the_routes_do_not_exist(tmp_path: Path, auth: dict[str, Any] | None) -> None:
    stack = _stack(tmp_path, admin={}, auth=auth)
    cfg = parse_config(stack)
    assert not cfg.controller.has_admin_key
    gateway = next(a for a in build_serve_config(cfg)["applications"] if a["name"] == GATEWAY_APP)
    assert "admin" not in gateway["args"]  # the rendered overlays of stacks without one are unchanged
    async with _gateway(stack, None) as gw:
        for path in ("/admin/promotions", "/admin/promotions/calc"):
            r = await gw.get(path, headers=_bearer(TENANT))
            assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_the_gateway_gets_the_record_and_the_hashes_never_a_key(tmp_path: Path) -> None:
    stack = _stack(tmp_path / "cfg", admin={"admin_key_hashes": [hash_key(ADMIN)], "admin_key_env": "K"})
    stack["checkpoint_root"] = "../store"
    cfg = parse_config(stack)
    (tmp_path / "cfg").mkdir()
    gateway = next(a for a in build_serve_config(cfg, tmp_path / "cfg")["applications"] if a["name"] == GATEWAY_APP)
    access = AdminAccess.model_validate(gateway["args"]["admin"])
    assert access.store_root == str((tmp_path / "store").resolve()) and access.stack == "t"
    assert access.key_env == "K" and ADMIN not in json.dumps(gateway)
    engines = [a for a in build_serve_config(cfg)["applications"] if "spec" in a["args"]]
    assert engines and all("K" in a["args"]["spec"]["secret_env"] for a in engines)  # vLLM never sees it
    with pytest.raises(ValueError, match="sha256"):
        parse_config(_stack(tmp_path, admin={"admin_key_hashes": ["plain-text-key"]}))


class _HeldFS(LocalFileSystem):
    """A local store whose reads wait until the test lets them go (a hung bucket)."""

    protocol = "heldfs"
    go = threading.Event()

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kw: Any) -> bytes:
        self.go.wait(30)
        return bytes(super().cat_file(path, start, end, **kw))


async def test_a_store_that_does_not_answer_is_a_503_and_a_broken_record_too(tmp_path: Path) -> None:
    fsspec.register_implementation("heldfs", _HeldFS, clobber=True)
    stack = _stack(tmp_path)
    held = AdminAccess(store_root=f"heldfs://{tmp_path}", stack="t", key_hashes=[hash_key(ADMIN)], timeout_s=0.05)
    try:
        async with _gateway(stack, held) as gw:
            hung = await gw.get("/admin/promotions", headers=_bearer(ADMIN))
    finally:
        _HeldFS.go.set()
    assert hung.status_code == 503 and "retry-after" in hung.headers, hung.text
    assert hung.json()["error"]["type"] == "service_unavailable"
    (tmp_path / ".control" / "t").mkdir(parents=True)
    (tmp_path / ".control" / "t" / "live.json").write_text("{not json")
    async with _gateway(stack, admin_access(parse_config(stack), None)) as gw:
        broken = await gw.get("/admin/promotions", headers=_bearer(ADMIN))
    assert broken.status_code == 503 and "Traceback" not in broken.text, broken.text
