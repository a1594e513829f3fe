"""What ``serving up`` set up around the integration stack's Ray head."""

from __future__ import annotations

from pathlib import Path

import grpc

from serving.config import load_config
from serving.control.stack import StackState
from tests.conftest import Stack
from tests.support.sockets import is_loopback, listening, process_tree


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw if b"=" in item)


def test_serve_controller_runs_with_the_configured_control_loop(stack: Stack) -> None:
    cfg = load_config(stack.config)
    state = StackState.load(cfg.name)
    assert state is not None
    token = str(state.token_path)
    controllers = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if not (proc / "cmdline").read_bytes().startswith(b"ray::ServeController"):
                continue
            env = _environ(int(proc.name))
        except OSError:  # gone meanwhile
            continue
        if env.get("RAY_AUTH_TOKEN_PATH") == token:  # this stack's head, not another one
            controllers.append(env)
    assert len(controllers) == 1
    assert cfg.local_ray.serve_control_loop_s == 0.1  # the default (the stack file does not set it)
    assert controllers[0]["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.1"


def _unauthenticated(port: int) -> grpc.StatusCode:
    """What a Serve replica's inter-deployment gRPC server answers a call without Ray's token."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(
            "/ray.serve.ASGIService/HandleRequest", request_serializer=bytes, response_deserializer=bytes
        )
        try:
            call(b"", timeout=10)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_every_port_of_the_local_stack_listens_on_loopback(stack: Stack) -> None:
    """The gateway, Ray's daemons and metrics ports and the engines listen on 127.0.0.1 only (Ray
    would put a loopback node address on the machine's network address: config.LOCAL_RAY_LOOPBACK).
    The one exception Ray hard-codes, each Serve replica's inter-deployment gRPC server on every
    interface, must refuse a call without Ray's token."""
    cfg = load_config(stack.config)
    state = StackState.load(cfg.name)
    assert state is not None
    pids = process_tree(state.ray_pid)
    assert any("/raylet" in cmd for cmd in pids.values())
    sockets = listening(pids)
    ports = {port for _, _, port in sockets}
    assert cfg.gateway.port in ports and cfg.local_ray.metrics_export_port in ports
    assert cfg.local_ray.dashboard_port in ports and cfg.local_ray.gcs_port in ports
    assert any("engine_main" in cmd for cmd, _, _ in sockets)  # the engines' HTTP ports are among them
    open_ = [(cmd, ip, port) for cmd, ip, port in sockets if not is_loopback(ip)]
    for title, ip, port in open_:
        assert title.startswith("ray::ServeReplica"), f"{title[:80]} listens on {ip}:{port}"
        assert _unauthenticated(port) == grpc.StatusCode.UNAUTHENTICATED, f"{title[:80]} on {ip}:{port}"
    assert len(open_) <= sum(title.startswith("ray::ServeReplica") for title in pids.values())
