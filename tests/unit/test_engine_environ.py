"""The vLLM engine's environment: what a replica's process holds that the engine must not get."""

from __future__ import annotations

from pathlib import Path

from serving.config import EngineConfig, load_config
from serving.control.serve_config import build_serve_config
from serving.replica.engine import OFFLINE_ENV, EngineSpec, engine_environ

REPO = Path(__file__).resolve().parents[2]

# what a serving worker pod's replica holds: its pod's env, its Secret (envFrom), Ray's own
REPLICA_ENV = {
    "PATH": "/usr/bin",
    "HOME": "/tmp/home",
    "LANG": "C.UTF-8",
    "LD_LIBRARY_PATH": "/usr/local/cuda/lib64",
    "PYTHONPATH": "/app",
    "HF_HOME": "/tmp/cache/huggingface",
    "XDG_CACHE_HOME": "/tmp/cache",
    "TOKENIZERS_PARALLELISM": "false",
    "NCCL_SOCKET_IFNAME": "eth0",
    "OMP_NUM_THREADS": "4",
    "CUDA_VISIBLE_DEVICES": "0",
    "VLLM_LOGGING_LEVEL": "INFO",
    "RAY_AUTH_MODE": "token",
    "RAY_AUTH_TOKEN": "ray-cluster-token",
    "RAY_AUTH_TOKEN_PATH": "/home/ray/.ray/auth_token",
    "RAY_ADDRESS": "10.0.0.5:6379",
    "RAYSTACK_CLIENT_KEY": "sk-client",
    "RAYSTACK_OTHER_SECRET": "in-the-secret-but-in-no-config",
    "KUBERNETES_SERVICE_HOST": "10.96.0.1",
    "AWS_SECRET_ACCESS_KEY": "aws",
    "HF_TOKEN": "hf",
}
PASSED = {k for k in REPLICA_ENV if not k.startswith(("RAY", "KUBERNETES_", "AWS_")) and k != "HF_TOKEN"}


def test_the_engine_gets_what_it_reads_and_no_key_or_ray_token() -> None:
    spec = EngineSpec(model="m", version="v1", path="/x", engine=EngineConfig(), secret_env=["VLLM_LOGGING_LEVEL"])
    env = engine_environ(REPLICA_ENV, spec, token="replica-token")
    added = set(OFFLINE_ENV) | {"VLLM_API_KEY", "VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING"}
    assert set(env) - added == PASSED - {"VLLM_LOGGING_LEVEL"}  # in secret_env: never passed, whatever its name
    assert {k: env[k] for k in PASSED - {"VLLM_LOGGING_LEVEL", "OMP_NUM_THREADS"}} == {
        k: REPLICA_ENV[k] for k in PASSED - {"VLLM_LOGGING_LEVEL", "OMP_NUM_THREADS"}
    }
    assert env["VLLM_API_KEY"] == "replica-token" and env["RAY_USAGE_STATS_ENABLED"] == "0"
    assert not any(v in ("ray-cluster-token", "sk-client", "in-the-secret-but-in-no-config") for v in env.values())


def test_every_key_the_stack_config_names_is_secret_env() -> None:
    """Tenants' keys, the admin key and the promotion controller's client key (a tenant's key)."""
    cfg = load_config(REPO / "deployments" / "gpu-prod.yaml")
    cfg = cfg.model_copy(
        update={
            "controller": cfg.controller.model_copy(
                update={"client_key_env": "RAYSTACK_CLIENT_KEY", "admin_key_env": "RAYSTACK_ADMIN_KEY"}
            )
        }
    )
    keys = {t.key_env for t in cfg.auth.tenants if t.key_env} | {"RAYSTACK_CLIENT_KEY", "RAYSTACK_ADMIN_KEY"}
    engines = [a for a in build_serve_config(cfg)["applications"] if "spec" in a["args"]]
    assert engines and all(keys <= set(a["args"]["spec"]["secret_env"]) for a in engines)
