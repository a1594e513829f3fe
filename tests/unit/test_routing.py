from __future__ import annotations

import os
import random
from collections import Counter
from pathlib import Path

import pytest

from serving.config import EngineConfig, ModelConfig, parse_config
from serving.control.serve_config import routing_user_config
from serving.errors import NotFound
from serving.gateway.routing import GatewayRoutes, RoutingTable
from serving.replica.engine import EngineSpec, single_process, vllm_command, vllm_env
from serving.replica.placement import cpu_bind_groups
from serving.replica.routers import pick_by_session


def _table(adder_weights: tuple[int, int] = (90, 10)) -> dict[str, object]:
    """The gateway's user_config for two models, built the way the control plane builds it."""
    v1, v2 = adder_weights
    return routing_user_config(
        parse_config(
            {
                "auth": {"mode": "open"},
                "gateway": {"default_model": "adder"},
                "models": [
                    {
                        "name": "adder",
                        "aliases": ["stable"],
                        "versions": [{"version": "v1", "weight": v1}, {"version": "v2", "weight": v2}],
                    },
                    {"name": "sub", "versions": [{"version": "v1"}]},
                ],
            }
        )
    )


TABLE = _table()


def _routes(user_config: dict[str, object]) -> RoutingTable:
    return RoutingTable.from_routes(GatewayRoutes.model_validate(user_config))


def test_resolve_names_aliases_versions_and_default() -> None:
    t = _routes(TABLE)
    assert t.resolve("adder@v2").version.app == "adder--v2"
    assert t.resolve("stable").model.name == "adder"
    assert t.resolve(None).model.name == "adder"
    assert t.resolve("sub").version.version == "v1"
    for bad in ("nope", "adder@v3", "sub@", "stable@"):
        with pytest.raises(NotFound):
            t.resolve(bad)


def test_weights_split_traffic() -> None:
    t = _routes(TABLE)
    rng = random.Random(0)
    counts = Counter(t.resolve("adder", rng).version.version for _ in range(5000))
    assert 0.07 < counts["v2"] / 5000 < 0.13


def test_zero_weight_version_gets_no_bare_traffic() -> None:
    cfg = _table((100, 0))
    t = _routes(cfg)
    assert {t.resolve("adder").version.version for _ in range(200)} == {"v1"}
    assert t.resolve("adder@v2").version.app == "adder--v2"


def test_session_hashing_is_stable_and_spreads() -> None:
    reps = ["r1", "r2", "r3"]
    assert pick_by_session("s-1", reps) == pick_by_session("s-1", list(reversed(reps)))
    assert len({pick_by_session(f"s-{i}", reps) for i in range(60)}) == 3
    # removing a replica moves only the sessions that were on it
    moved = [
        i
        for i in range(200)
        if pick_by_session(f"s-{i}", reps) != "r3"
        and pick_by_session(f"s-{i}", reps) != pick_by_session(f"s-{i}", reps[:2])
    ]
    assert moved == []


def test_engine_command_and_env() -> None:
    spec = EngineSpec(
        model="adder",
        version="v1",
        path="/ck/adder/v1",
        engine=EngineConfig(
            max_model_len=64, tensor_parallel_size=2, extra_args={"enforce-eager": True, "block_size": 16}
        ),
    )
    cmd = vllm_command(spec, "127.0.0.1", 9000)
    assert cmd[:2] == ["-m", "vllm.entrypoints.launchers.api_server.entry"]
    assert cmd[cmd.index("--served-model-name") + 1] == "adder"
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    assert "--enforce-eager" in cmd and cmd[cmd.index("--block-size") + 1] == "16"
    assert "--enable-log-requests" not in cmd
    # the token is in the environment, never on the command line (ps shows it to every user)
    assert not any("api-key" in a or "tok" in a for a in cmd)
    assert cmd[cmd.index("--middleware") + 1] == "serving.replica.engine_guard.RequireToken"
    assert vllm_env(spec, token="tok")["VLLM_API_KEY"] == "tok"
    env = vllm_env(spec)
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert "VLLM_CPU_OMP_THREADS_BIND" in env
    assert cpu_bind_groups(2, [0, 1]) == "0|1"
    assert cpu_bind_groups(2, [0, 1, 2, 3]) == "0,1|2,3"
    with pytest.raises(ValueError):
        cpu_bind_groups(4, [0, 1])


def test_engines_of_one_node_get_cores_apart(tmp_path: Path) -> None:
    import subprocess
    import sys

    from serving.replica.placement import claim_cores

    ledger = tmp_path / "cores.json"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    me = os.getpid()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert claim_cores(1, sleeper.pid, [0, 1], ledger) == [0]
        assert claim_cores(1, me, [0, 1], ledger) == [1]  # the free core, not vLLM's default 0
        assert claim_cores(1, dead.pid, [0, 1], ledger) == [0]  # both taken once: least used, lowest
        # had the dead claim on 0 counted, core 1 would be the less used one
        assert claim_cores(1, dead.pid + 10**6, [0, 1], ledger) == [0]
        assert claim_cores(4, me, [0, 1], ledger) == [0, 1]  # never more than the node has
        wide = tmp_path / "wide.json"
        assert claim_cores(2, sleeper.pid, [0, 1, 2, 3], wide) == [0, 1]
        assert claim_cores(2, me, [0, 1, 2, 3], wide) == [2, 3]  # cpus_per_rank 2: two cores each
    finally:
        sleeper.kill()
        sleeper.wait()
    spec = EngineSpec(model="m", version="v1", path="/p", engine=EngineConfig(tensor_parallel_size=2))
    assert vllm_env(spec, [2, 3])["VLLM_CPU_OMP_THREADS_BIND"] == "2|3"
    mp = EngineSpec(
        model="m", version="v1", path="/p", engine=EngineConfig(extra_args={"distributed_executor_backend": "mp"})
    )
    assert vllm_env(mp, [1])["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in vllm_env(mp)  # no ledger: vLLM's own choice


def test_one_rank_cpu_engines_run_in_one_process() -> None:
    """vLLM's CPU platform would start a separate worker process that spin-waits with EngineCore;
    one rank runs in EngineCore itself (executor ``uni``), with cpus_per_rank OpenMP threads."""
    one = EngineSpec(model="m", version="v1", path="/p", engine=EngineConfig(), cpus_per_rank=2)
    assert single_process(one)
    cmd = vllm_command(one, "127.0.0.1", 9000)
    assert cmd[cmd.index("--distributed-executor-backend") + 1] == "uni"
    env = vllm_env(one, [0, 1])
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["OMP_NUM_THREADS"] == "2"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env
    # an executor named in extra_args wins, given once
    for backend in ("mp", "uni"):
        named = EngineSpec(
            model="m",
            version="v1",
            path="/p",
            engine=EngineConfig(extra_args={"distributed-executor-backend": backend}),
        )
        cmd = vllm_command(named, "127.0.0.1", 9000)
        assert cmd.count("--distributed-executor-backend") == 1
        assert ("VLLM_ENABLE_V1_MULTIPROCESSING" in vllm_env(named)) == (backend == "uni")
    # more than one rank, or a GPU: vLLM's multiprocess executor as before
    tp2 = EngineSpec(model="m", version="v1", path="/p", engine=EngineConfig(tensor_parallel_size=2))
    gpu = EngineSpec(model="m", version="v1", path="/p", engine=EngineConfig(), use_gpu=True, gpus_per_rank=1)
    for spec in (tp2, gpu):
        assert not single_process(spec)
        assert "--distributed-executor-backend" not in vllm_command(spec, "127.0.0.1", 9000)
        assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in vllm_env(spec)


def _model(**engine: object) -> ModelConfig:
    from serving.config import ModelConfig

    return ModelConfig.model_validate({"name": "m", "versions": [{"version": "v1"}], "engine": engine})


def test_layout_checks() -> None:
    from serving.config import ConfigError
    from serving.replica.engine import check_layout

    hf = {"num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 3}
    check_layout(_model(tensor_parallel_size=2), hf, 8, None)
    with pytest.raises(
        ConfigError, match=r"models\[m\].engine.tensor_parallel_size: 3 does not divide num_attention_heads=4"
    ):
        check_layout(_model(tensor_parallel_size=3), hf, 8, None)
    with pytest.raises(ConfigError, match="pipeline_parallel_size: 4 stages but only 3 layers"):
        check_layout(_model(pipeline_parallel_size=4), hf, 8, None)
    with pytest.raises(ConfigError, match="need 4 CPUs on one node, the node has 2"):
        check_layout(_model(tensor_parallel_size=4), {"num_attention_heads": 8}, 2, None)


def test_gateway_autoscaling_renders() -> None:
    from serving.config import parse_config
    from serving.control.serve_config import build_serve_config

    cfg = parse_config(
        {
            "auth": {"mode": "open"},
            "gateway": {"autoscaling": {"min_replicas": 1, "max_replicas": 4}},
            "models": [{"name": "m", "versions": [{"version": "v1"}]}],
        }
    )
    gw = build_serve_config(cfg)["applications"][0]["deployments"][0]
    assert gw["autoscaling_config"]["max_replicas"] == 4 and "num_replicas" not in gw


def test_single_process_engine_is_pinned_apart_from_its_api_server(tmp_path: Path) -> None:
    """Real processes: an "API server" whose child names itself like vLLM's EngineCore."""
    import subprocess
    import sys
    import time

    from serving.replica.placement import EnginePinning, claim_cores, engine_core_pid, spare_cores

    cpus = sorted(os.sched_getaffinity(0))
    assert len(cpus) >= 2, "the pinning test needs two cores (CI has two)"
    child = "import ctypes, time; ctypes.CDLL(None).prctl(15, b'VLLM::EngineCore', 0, 0, 0); time.sleep(60)"
    api = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)",
        ]
    )
    ledger = tmp_path / "cores.json"
    try:
        deadline = time.monotonic() + 20
        while (engine := engine_core_pid(api.pid)) is None:
            assert time.monotonic() < deadline, "the EngineCore stand-in did not start"
            time.sleep(0.05)
        cores = claim_cores(1, api.pid, cpus, ledger)
        assert cores == [cpus[0]] and spare_cores(cores, cpus, ledger) == cpus[1:]
        pinning = EnginePinning(api.pid, engine, cores, cpus, ledger)
        assert pinning.apply() == cpus[1:]
        assert os.sched_getaffinity(engine) == {cpus[0]} and os.sched_getaffinity(api.pid) == set(cpus[1:])
        assert pinning.apply() is None  # nothing changed on the node: nothing to re-apply
        # another engine claims the remaining cores: nothing spare, so both are unpinned again
        assert claim_cores(len(cpus), os.getpid(), cpus, ledger) == cpus
        assert spare_cores(cores, cpus, ledger) == []
        assert pinning.apply() == []
        assert os.sched_getaffinity(engine) == set(cpus) == os.sched_getaffinity(api.pid)
        assert engine_core_pid(engine) is None  # the stand-in started no EngineCore of its own
    finally:
        subprocess.run(["pkill", "-P", str(api.pid)], check=False)
        api.kill()
        api.wait()


def test_vllm_parses_the_command_with_the_guard_and_no_token() -> None:
    """vLLM's own parser takes the command: the guard middleware is loaded, no key is on it (the
    token is VLLM_API_KEY in the environment, so one starting with "-" cannot pass for an option)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from serving.replica.engine import vllm_command

    spec = EngineSpec(model="m", version="v1", path="/p", engine=EngineConfig())
    args = vllm_command(spec, "127.0.0.1", 8000)
    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(args[2:])
    assert ns.middleware == ["serving.replica.engine_guard.RequireToken"] and not ns.api_key
    assert ns.port == 8000 and ns.model == "/p"
