from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from serving.config import ConfigError, load_config, parse_config
from serving.control.serve_config import build_serve_config, routing_user_config

ROOT = Path(__file__).resolve().parents[2]
MODEL = {"name": "adder", "versions": [{"version": "v1"}]}
OPEN = {"mode": "open"}


def _cfg(**over: object) -> dict[str, object]:
    return {"auth": OPEN, "models": [MODEL], **over}


@pytest.mark.parametrize(
    "path",
    sorted((ROOT / "deployments").glob("*.yaml"))
    + sorted((ROOT / "loadtests" / "stacks").glob("*.yaml"))
    + [ROOT / "tests/integration/stack.yaml", ROOT / "tests/e2e/scaling-stack.yaml"],
)
def test_shipped_configs_validate(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.models


def test_local_default_serves_two_models_of_different_families() -> None:
    cfg = load_config(ROOT / "deployments/local.yaml")
    assert len(cfg.models) >= 2
    bases = {v.recipe.base.split("-")[0] for m in cfg.models for v in m.versions if v.recipe}
    assert len(bases) >= 2, bases


@pytest.mark.parametrize(
    ("data", "where"),
    [
        (_cfg(gatway={}), "gatway: Extra inputs are not permitted"),
        (_cfg(models=[{**MODEL, "engine": {"dtype": "float64"}}]), "models[adder].engine.dtype"),
        (_cfg(models=[{**MODEL, "engine": {"max_model_len": "long"}}]), "models[adder].engine.max_model_len"),
        (
            _cfg(models=[{"name": "adder", "versions": [{"version": "v1", "wieght": 5}]}]),
            "models[adder].versions[v1].wieght",
        ),
        (_cfg(models=[{"name": "Bad_Name", "versions": [{"version": "v1"}]}]), "models[Bad_Name].name"),
        (_cfg(models=[{"name": "a", "versions": [{"version": "v1", "weight": 50}]}]), "add up to 100"),
        (_cfg(models=[MODEL, MODEL]), "used twice"),
        (_cfg(models=[{**MODEL, "aliases": ["adder"]}]), "used twice"),
        (_cfg(models=[]), "models"),
        (_cfg(gateway={"default_model": "ghost"}), "is no model"),
        (
            _cfg(models=[{**MODEL, "deployment": {"autoscaling": {"min_replicas": 3, "max_replicas": 1}}}]),
            "min_replicas must be <= max_replicas",
        ),
        ({"models": [MODEL]}, "auth: Field required"),
        (_cfg(auth={"mode": "keys"}), "needs at least one tenant"),
        (_cfg(auth={"tenants": [{"name": "t", "models": ["*"]}]}), "needs key_hashes or key_env"),
        (_cfg(auth={"tenants": [{"name": "t", "key_env": "K", "models": ["ghost"]}]}), "unknown models"),
        (_cfg(auth={"tenants": [{"name": "t", "key_hashes": ["plain-text-key"]}]}), "sha256$"),
        (_cfg(auth={"tenants": [{"name": "t", "key_env": "K", "rpm": 0}]}), "auth.tenants[t].rpm"),
    ],
)
def test_invalid_configs_name_the_field(data: dict[str, object], where: str, tmp_path: Path) -> None:
    f = tmp_path / "stack.yaml"
    f.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as exc:
        load_config(f)
    assert str(f) in str(exc.value)
    assert where in str(exc.value)


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_serve_config_layout_and_options() -> None:
    cfg = parse_config(
        {
            "auth": OPEN,
            "checkpoint_root": "/ck",
            "models": [
                {
                    "name": "adder",
                    "aliases": ["default"],
                    "versions": [{"version": "v1", "weight": 90}, {"version": "v2", "weight": 10}],
                    "engine": {"max_model_len": 64, "tensor_parallel_size": 2},
                    "deployment": {"router": "session_affinity", "autoscaling": {"min_replicas": 0, "max_replicas": 3}},
                },
                {"name": "big", "versions": [{"version": "v1"}], "deployment": {"gpus_per_rank": 1}},
            ],
        }
    )
    sc = build_serve_config(cfg)
    names = [a["name"] for a in sc["applications"]]
    assert names == ["gateway", "adder--v1", "adder--v2", "big--v1", "promotion-controller"]
    adder = sc["applications"][1]
    assert adder["route_prefix"] is None
    dep = adder["deployments"][0]
    assert dep["placement_group_bundles"] == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert dep["placement_group_strategy"] == "STRICT_PACK"
    assert dep["autoscaling_config"]["min_replicas"] == 0 and "num_replicas" not in dep
    assert dep["request_router_config"]["request_router_class"].endswith("SessionAffinityRouter")
    assert adder["args"]["spec"]["path"] == "/ck/adder/v1"
    big = sc["applications"][3]["deployments"][0]
    assert big["placement_group_bundles"] == [{"CPU": 1.0, "GPU": 1.0}]
    assert big["ray_actor_options"]["num_gpus"] == 1.0
    routes = routing_user_config(cfg)["models"][0]
    assert [(v["version"], v["weight"], v["app"]) for v in routes["versions"]] == [
        ("v1", 90, "adder--v1"),
        ("v2", 10, "adder--v2"),
    ]


def test_serve_config_passes_rays_own_schema() -> None:
    from ray.serve.schema import ServeDeploySchema

    cfg = load_config(ROOT / "deployments/local.yaml")
    ServeDeploySchema.model_validate(build_serve_config(cfg, ROOT / "deployments"))


def test_relative_checkpoint_paths_resolve_from_the_config_folder() -> None:
    cfg = load_config(ROOT / "deployments/local.yaml")
    sc = build_serve_config(cfg, ROOT / "deployments")
    assert sc["applications"][1]["args"]["spec"]["path"] == str(ROOT / "checkpoints/adder/v1")


def test_configuration_reference_is_current() -> None:
    from serving.control.reference import config_reference

    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert doc == config_reference(), "run: serving config-reference > docs/configuration.md"


def test_typed_config_crosses_the_serve_boundary_unchanged() -> None:
    """The gateway's init arg and user_config are the control plane's models dumped to JSON;
    the gateway validates them back into the same models (no defaults restated on its side)."""
    from serving.config import GatewayConfig
    from serving.gateway.routing import GatewayRoutes

    cfg = load_config(ROOT / "tests" / "integration" / "stack.yaml")
    (gateway,) = [a for a in build_serve_config(cfg)["applications"] if a["name"] == "gateway"]
    from serving.control.serve_config import GATEWAY_SHAPE

    args = GatewayConfig.model_validate(gateway["args"]["config"])
    assert args.model_dump(exclude=GATEWAY_SHAPE) == cfg.gateway.model_dump(exclude=GATEWAY_SHAPE)
    # the deployment's shape is Serve's options, not init args: scaling does not restart replicas
    bigger = cfg.model_copy(update={"gateway": cfg.gateway.model_copy(update={"num_replicas": 5})})
    (scaled,) = [a for a in build_serve_config(bigger)["applications"] if a["name"] == "gateway"]
    assert scaled["args"] == gateway["args"] and scaled["deployments"][0]["num_replicas"] == 5
    routes = GatewayRoutes.model_validate(gateway["deployments"][0]["user_config"])
    assert routes.auth == cfg.auth and [m.name for m in routes.models] == [m.name for m in cfg.models]
    assert routes.models[1].max_ongoing_requests == cfg.models[1].deployment.max_ongoing_requests
    broken = {**gateway["deployments"][0]["user_config"], "unknown": 1}
    with pytest.raises(ValueError, match="unknown"):
        GatewayRoutes.model_validate(broken)


@pytest.mark.parametrize(
    ("key", "why"),
    [
        ("model", "verified files"),
        ("--tokenizer", "verified files"),
        ("lora_modules", "verified files"),
        ("host", "every route behind its token"),
        ("api-key", "command line"),
        ("kv-events-config", "prompt tokens"),
        ("enable-log-requests", "out of the logs"),
        ("enable_log_outputs", "out of the logs"),
    ],
)
def test_extra_args_cannot_override_what_the_stack_sets_for_safety(key: str, why: str) -> None:
    """vLLM takes the last of two equal flags, and extra_args come after the stack's own."""
    model = {**MODEL, "engine": {"extra_args": {key: "x"}}}
    with pytest.raises(ConfigError, match=f"extra_args must not set '{key}'.*{why}"):
        parse_config(_cfg(models=[model]))
    assert parse_config(_cfg(models=[{**MODEL, "engine": {"extra_args": {"enforce-eager": True}}}]))


@pytest.mark.parametrize(("host", "refused"), [("0.0.0.0", True), ("10.1.2.3", True), ("myhost", True),
                                               ("127.0.0.1", False), ("::1", False), ("localhost", False)])  # fmt: skip
def test_serving_up_refuses_an_open_gateway_that_other_machines_reach(host: str, refused: bool) -> None:
    from serving.control.stack import check_exposure

    cfg = parse_config(_cfg(gateway={"host": host}))
    if refused:
        with pytest.raises(ConfigError, match=f"gateway.host is '{host}' with auth.mode 'open'"):
            check_exposure(cfg)
    else:
        check_exposure(cfg)
    keys = {"mode": "keys", "tenants": [{"name": "t", "key_env": "K", "models": ["*"]}]}
    check_exposure(parse_config(_cfg(gateway={"host": host}, auth=keys)))  # keys: any address


@pytest.mark.parametrize(("first", "second"), [(("adder", "v1"), ("adder", "V1")), (("a", "b--c"), ("a--b", "c"))])
def test_two_versions_with_one_serve_application_name_are_refused(
    first: tuple[str, str], second: tuple[str, str]
) -> None:
    models = [{"name": n, "versions": [{"version": v, "weight": 100}]} for n, v in (first, second)]
    if first[0] == second[0]:
        models = [
            {"name": first[0], "versions": [{"version": first[1], "weight": 100}, {"version": second[1], "weight": 0}]}
        ]
    cfg = parse_config(_cfg(models=models))
    with pytest.raises(ConfigError, match=f"{first[0]}@{first[1]} and {second[0]}@{second[1]} would both be"):
        build_serve_config(cfg)
