"""Rules of the stack config across its sections: keys with one holder each, key hash format,
alias and stack names, local ports apart, a gateway that keeps listening, a checkpoint store this
machine can open, unreadable config files; and what `serving render-k8s` checks against the
values the manifests under k8s/ fix."""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import Any

import pytest
import yaml
from fsspec.registry import known_implementations

from serving.config import ConfigError, load_config, parse_config
from serving.control import k8s
from serving.control.k8s import K8sError, render_serve_config_v2
from serving.gateway.admission.auth import hash_key
from tests.unit.test_config import _cfg

REPO = Path(__file__).resolve().parents[2]
LOCAL = yaml.safe_load((REPO / "deployments" / "local.yaml").read_text())
H1, H2 = hash_key("sk-one"), hash_key("sk-two")


def _refused(data: dict[str, Any], *expected: str) -> str:
    with pytest.raises(ConfigError) as exc:
        parse_config(data)
    for text in expected:
        assert text in str(exc.value), str(exc.value)
    return str(exc.value)


def _keys(*tenants: dict[str, Any], controller: dict[str, Any] | None = None) -> dict[str, Any]:
    auth = {"mode": "keys", "tenants": list(tenants)}
    return _cfg(auth=auth, **({"controller": controller} if controller else {}))


# --- one key, one holder -------------------------------------------------------------------------


def test_two_tenants_with_one_key_env_are_refused() -> None:
    _refused(_keys({"name": "a", "key_env": "K"}, {"name": "b", "key_env": "K"}), "auth:", "'a' and 'b'", "'K'")


def test_two_tenants_with_one_key_hash_are_refused() -> None:
    data = _keys({"name": "a", "key_hashes": [H1]}, {"name": "b", "key_hashes": [H2, H1]})
    _refused(data, "auth:", "'a' and 'b'", "key_hashes", H1)


def test_an_admin_key_env_that_is_a_tenants_key_env_is_refused() -> None:
    data = _keys({"name": "a", "key_env": "K"}, {"name": "b", "key_env": "KB"}, controller={"admin_key_env": "KB"})
    _refused(data, "controller.admin_key_env", "auth.tenants[b].key_env", "'KB'")


def test_an_admin_key_env_that_is_the_client_key_env_is_refused() -> None:
    data = _keys({"name": "a", "key_env": "K"}, controller={"admin_key_env": "KA", "client_key_env": "KA"})
    _refused(data, "controller:", "admin_key_env and client_key_env", "'KA'")


def test_an_admin_key_hash_that_a_tenant_lists_is_refused() -> None:
    data = _keys({"name": "a", "key_hashes": [H1]}, controller={"admin_key_hashes": [H2, H1]})
    _refused(data, "controller.admin_key_hashes", "auth.tenants[a].key_hashes", H1)


def test_the_client_key_env_may_be_a_tenants_key_and_distinct_keys_pass() -> None:
    cfg = parse_config(
        _keys(
            {"name": "a", "key_env": "KA", "key_hashes": [H1]},
            {"name": "b", "key_env": "KB"},
            controller={"client_key_env": "KA", "admin_key_env": "KADMIN", "admin_key_hashes": [H2]},
        )
    )
    assert cfg.controller.client_key_env == cfg.auth.tenants[0].key_env


# --- key hash format -----------------------------------------------------------------------------

DIGEST = hashlib.sha256(b"0123456789abcdefsk-one").hexdigest()


@pytest.mark.parametrize(
    "bad",
    [
        f"sha256$0123456789abcdef${DIGEST.upper()}",  # upper-case digest
        "sha256$0123456789abcdef$" + "z" * 64,  # not hex
        "sha256$$" + hashlib.sha256(b"sk-one").hexdigest(),  # no salt: a bare sha256 of the key
        f"sha256$0123abc${DIGEST}",  # salt shorter than 8
        f"sha256$salty-salt${DIGEST}",  # salt not hex
        f"sha256$0123456789abcdef${DIGEST[:63]}",  # 63 digits
        f"md5$0123456789abcdef${DIGEST}",
    ],
)
def test_malformed_key_hashes_are_refused_with_the_form_and_the_command(bad: str) -> None:
    for data in (
        _keys({"name": "a", "key_hashes": [bad]}),
        _keys({"name": "a", "key_env": "K"}, controller={"admin_key_hashes": [bad]}),
    ):
        text = _refused(data, "sha256$<salt: 8 or more lower-case hex digits>$<64 lower-case hex digits>")
        assert "serving keys hash --from-env" in text and bad not in text


def test_hashes_the_cli_makes_are_accepted() -> None:
    cfg = parse_config(_keys({"name": "a", "key_hashes": [H1, hash_key("sk-one", "0123abcd")]}))
    assert len(cfg.auth.tenants[0].key_hashes) == 2


# --- names ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("alias", ["adder@v1", "chat@latest", "My Model", "two words", "", "Upper"])
def test_aliases_follow_the_model_name_rule(alias: str) -> None:
    data = _cfg(models=[{"name": "adder", "aliases": ["ok", alias], "versions": [{"version": "v1"}]}])
    _refused(data, "models[adder].aliases", f"alias {alias!r}", "lower-case letters, digits and '-'")


@pytest.mark.parametrize("name", ["../x", "../../etc/x", "a/b", "", "Local", "a b", "x" * 41])
def test_the_stack_name_follows_the_model_name_rule(name: str) -> None:
    _refused(_cfg(name=name), "  name: ", "the stack name must be")


def test_valid_stack_names_and_aliases_pass() -> None:
    cfg = parse_config(
        _cfg(
            name="gpu-prod",
            models=[{"name": "adder", "aliases": ["default", "chat-2"], "versions": [{"version": "v1"}]}],
        )
    )
    assert cfg.name == "gpu-prod" and cfg.models[0].aliases == ["default", "chat-2"]


# --- local ports ---------------------------------------------------------------------------------


def _local(**changes: dict[str, Any]) -> dict[str, Any]:
    data = copy.deepcopy(LOCAL)
    for section, values in changes.items():
        data[section].update(values)
    return data


@pytest.mark.parametrize(
    ("changes", "first", "second", "port"),
    [
        ({"gateway": {"port": 8080}}, "gateway.port", "local_ray.metrics_export_port", 8080),
        ({"gateway": {"port": 6379}}, "gateway.port", "local_ray.gcs_port", 6379),
        (
            {"gateway": {"port": 8264}},
            "gateway.proxy_port (default gateway.port + 1)",
            "local_ray.dashboard_port",
            8265,
        ),
        ({"gateway": {"proxy_port": 8080}}, "gateway.proxy_port", "local_ray.metrics_export_port", 8080),
        ({"local_ray": {"dashboard_port": 6379}}, "local_ray.gcs_port", "local_ray.dashboard_port", 6379),
        (
            {"local_ray": {"metrics_export_port": 8001}},
            "gateway.proxy_port (default gateway.port + 1)",
            "local_ray.metrics_export_port",
            8001,
        ),
        ({"gateway": {"ingress": "serve_proxy", "port": 8265}}, "gateway.port", "local_ray.dashboard_port", 8265),
    ],
)
def test_two_local_ports_alike_are_refused(changes: dict[str, Any], first: str, second: str, port: int) -> None:
    _refused(_local(**changes), f"{first} and {second} are both {port}")


def test_ports_apart_pass_and_serve_proxy_ingress_has_no_second_port() -> None:
    parse_config(_local(gateway={"ingress": "serve_proxy", "port": 8001}, local_ray={"metrics_export_port": 8002}))
    e2e = {  # tests/e2e/test_promotion.py's stack
        "gateway": {"port": 8013, "proxy_port": 8113},
        "local_ray": {"gcs_port": 6394, "dashboard_port": 8279, "metrics_export_port": 8089, "num_cpus": 8},
    }
    parse_config(_cfg(**e2e))


# --- a gateway that keeps listening --------------------------------------------------------------


def test_gateway_autoscaling_to_zero_with_the_listener_ingress_is_refused() -> None:
    scaling = {"min_replicas": 0, "max_replicas": 2}
    _refused(_cfg(gateway={"autoscaling": scaling}), "gateway:", "autoscaling.min_replicas must be at least 1")
    parse_config(_cfg(gateway={"autoscaling": {**scaling, "min_replicas": 1}}))
    parse_config(_cfg(gateway={"autoscaling": scaling, "ingress": "serve_proxy"}))


# --- the checkpoint store ------------------------------------------------------------------------


def test_a_checkpoint_root_of_an_unknown_protocol_is_refused() -> None:
    _refused(_cfg(checkpoint_root="nosuchfs://bucket/models"), "checkpoint_root:", "'nosuchfs'", "knows no protocol")
    _refused(_cfg(checkpoint_root="simplecache::nosuchfs://b/m"), "checkpoint_root:", "'nosuchfs'")


def test_a_checkpoint_root_whose_filesystem_package_is_missing_here_still_loads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``render-k8s`` of a cluster's config on a machine without the store's package."""
    impl = {"class": "raystack_no_such_module.FileSystem", "err": "Install raystack-no-such-module for nopkg://"}
    monkeypatch.setitem(known_implementations, "nopkg", impl)
    assert parse_config(_cfg(checkpoint_root="nopkg://bucket/m")).checkpoint_root == "nopkg://bucket/m"


def test_local_and_known_checkpoint_roots_pass() -> None:
    for root in ("checkpoints", "/mnt/checkpoints", "memory://ck", "file:///tmp/ck", "s3://bucket/models"):
        assert parse_config(_cfg(checkpoint_root=root)).checkpoint_root == root


# --- unreadable config files ---------------------------------------------------------------------


def test_a_directory_or_a_non_utf8_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"{tmp_path}: is a directory"):
        load_config(tmp_path)
    latin1 = tmp_path / "stack.yaml"
    latin1.write_bytes("name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=f"{latin1}: not UTF-8 text"):
        load_config(latin1)


# --- render-k8s against the manifests' fixed values ----------------------------------------------


def _gpu_prod(tmp_path: Path, **changes: dict[str, Any]) -> Path:
    data = yaml.safe_load((REPO / "deployments" / "gpu-prod.yaml").read_text())
    for section, values in changes.items():
        data[section] = {**data.get(section, {}), **values}
    path = tmp_path / "stack.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"gateway": {"port": 9000}}, ["gateway.port is 9000", "on 8000"]),
        ({"gateway": {"proxy_port": 8002}}, ["gateway.proxy_port", "is 8002", "open 8001"]),
        (
            {"shutdown": {"grace_s": 86}},
            ["shutdown.notice_s + shutdown.grace_s", "terminationGracePeriodSeconds", "is 90", "at most 85"],
        ),
        (
            {"shutdown": {"grace_s": 81, "notice_s": 10}},
            ["shutdown.notice_s + shutdown.grace_s", "is 90", "at most 80"],
        ),
    ],
)
def test_render_k8s_refuses_what_the_manifests_do_not_fit(
    tmp_path: Path, changes: dict[str, Any], expected: list[str]
) -> None:
    with pytest.raises(K8sError) as exc:
        render_serve_config_v2(_gpu_prod(tmp_path, **changes))
    for text in expected:
        assert text in str(exc.value), str(exc.value)


def test_render_k8s_accepts_a_budget_that_fits(tmp_path: Path) -> None:
    assert render_serve_config_v2(_gpu_prod(tmp_path, shutdown={"grace_s": 85}, gateway={"proxy_port": 8001}))


def _walk(node: Any, key: str) -> list[Any]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == key] + [x for v in node.values() for x in _walk(v, key)]
    if isinstance(node, list):
        return [x for v in node for x in _walk(v, key)]
    return []


def test_the_manifest_values_render_k8s_checks_are_those_of_k8s() -> None:
    """The constants of serving/control/k8s.py, read back from the files (no kubectl needed)."""
    docs = [
        d
        for f in sorted((REPO / "k8s").rglob("*.yaml"))
        if f.name != "serve-config.yaml"
        for d in yaml.safe_load_all(f.read_text())
        if isinstance(d, dict)
    ]
    services = [d for d in docs if d.get("kind") == "RayService"]
    graces = {g for d in services for g in _walk(d, "terminationGracePeriodSeconds")}
    assert graces == {k8s.K8S_TERMINATION_GRACE_S}
    pre_stops = [p["exec"]["command"] for d in services for p in _walk(d, "preStop")]
    assert pre_stops and all(c == ["sleep", str(k8s.K8S_PRESTOP_SLEEP_S)] for c in pre_stops)
    serve_ports = {
        p.get("containerPort", p.get("targetPort"))
        for d in services
        for ps in _walk(d, "ports")
        for p in ps
        if p.get("name") == "serve"
    }
    assert serve_ports == {k8s.K8S_GATEWAY_PORT}
    policy_ports = [p for d in docs if d.get("kind") == "NetworkPolicy" for ps in _walk(d, "ports") for p in ps]
    assert {"protocol": "TCP", "port": k8s.K8S_GATEWAY_PORT, "endPort": k8s.K8S_PROXY_PORT} in policy_ports


# --- adapter recipes train what the deploy serves -------------------------------------------------


def _adapter_recipe(recipe: dict[str, Any], lora: dict[str, Any] | None = None) -> dict[str, Any]:
    base = {"name": "calc", "versions": [{"version": "v1"}, {"version": "v2", "weight": 0}]}
    adapter = {"name": "sub", "base": "calc", "versions": [{"version": "v1", "recipe": recipe}]}
    return _cfg(models=[base | ({"lora": lora} if lora is not None else {}), adapter])


LORA = {"data": "builtin:sub", "method": "lora"}


@pytest.mark.parametrize(
    ("recipe", "lora", "expected"),
    [
        ({"base": "calc@v1", "lora_rank": 64}, {"max_lora_rank": 16}, "recipe.lora_rank 64 exceeds"),
        ({"base": "calc@v1", "lora_rank": 32}, None, "models[calc].lora.max_lora_rank 16"),  # the default slots
        ({"base": "calc@v1"}, {"max_lora_rank": 1}, "recipe.lora_rank (default 8) exceeds"),
        ({"base": "other@v3"}, None, "recipe.base 'other@v3'"),  # another model
        ({"base": "calc@v3"}, None, "recipe.base 'calc@v3'"),  # a version calc does not serve
        ({"base": "calc"}, None, "recipe.base 'calc'"),
        ({"base": "init:qwen3-tiny"}, None, "recipe.base 'init:qwen3-tiny'"),
    ],
)
def test_an_adapter_recipe_the_deploy_would_refuse_is_refused_naming_the_field(
    recipe: dict[str, Any], lora: dict[str, Any] | None, expected: str
) -> None:
    message = _refused(_adapter_recipe(LORA | recipe, lora), "models[sub].versions[v1].recipe.", expected)
    if "base '" in expected:
        assert "calc@v1, calc@v2" in message  # what it could train on


def test_adapter_recipes_the_deploy_serves_pass() -> None:
    cfg = parse_config(_adapter_recipe(LORA | {"base": "calc@v2", "lora_rank": 16}))  # at weight 0: served too
    assert cfg.model("sub").versions[0].recipe is not None
    parse_config(_adapter_recipe(LORA | {"base": "calc@v1"}, {"max_lora_rank": 8}))  # the default rank, 8
    parse_config(_adapter_recipe(LORA | {"base": "calc@v1", "lora_rank": 64}, {"max_lora_rank": 64}))


def test_a_live_config_that_dropped_a_recipes_base_version_still_builds() -> None:
    """The recipes are the config as written's: the controller's record may have removed the base
    version an untrained adapter version's recipe names (with_live validates without the check)."""
    from serving.control.controller import with_live

    seed = parse_config(_adapter_recipe(LORA | {"base": "calc@v2"}))
    live = with_live(seed, {"calc": [("v1", 100)]})
    assert [v.version for v in live.model("calc").versions] == ["v1"]


def test_the_default_lora_rank_is_the_training_jobs() -> None:
    from serving.config.base import DEFAULT_LORA_RANK
    from training.lora import LoraOptions

    assert DEFAULT_LORA_RANK == LoraOptions.rank


def test_the_shipped_adapter_recipes_pass_the_recipe_check() -> None:
    cfg = load_config(REPO / "tests" / "integration" / "stack.yaml")
    recipes = {m.name: v.recipe for m in cfg.models if m.base for v in m.versions if v.recipe}
    assert sorted(recipes) == ["max-lora", "sub-lora"]
    assert all(r.base == "adder@v1" and r.lora_rank == 16 for r in recipes.values())
