"""What ``serving up`` set up around the integration stack's Ray head."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import grpc
import psutil

from serving.config import load_config
from serving.control.stack import StackState
from tests.conftest import Stack


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


def _stack_pids(ray_pid: int) -> dict[int, str]:
    """pid -> command line (a Ray worker's is its title) of every process under the stack's
    ``ray start``: Ray's daemons and workers, and the engines the replicas start."""
    found = {}
    for proc in psutil.Process(ray_pid).children(recursive=True):
        try:
            found[proc.pid] = " ".join(proc.cmdline())
        except psutil.Error:  # gone meanwhile
            continue
    return found


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


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
    pids = _stack_pids(state.ray_pid)
    assert any("/raylet" in cmd for cmd in pids.values())
    listening = [
        (c.pid, c.laddr.ip, c.laddr.port)
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.pid in pids
    ]
    ports = {port for _, _, port in listening}
    assert cfg.gateway.port in ports and cfg.local_ray.metrics_export_port in ports
    assert cfg.local_ray.dashboard_port in ports and cfg.local_ray.gcs_port in ports
    engines = [pid for pid in pids if "engine_main" in pids[pid]]
    assert engines and any(pid in engines for pid, _, _ in listening)  # the engines' HTTP ports are seen
    open_ = [(pids[pid], ip, port) for pid, ip, port in listening if not _loopback(ip)]
    for title, ip, port in open_:
        assert title.startswith("ray::ServeReplica"), f"{title[:80]} listens on {ip}:{port}"
        assert _unauthenticated(port) == grpc.StatusCode.UNAUTHENTICATED, f"{title[:80]} on {ip}:{port}"
    assert len(open_) <= sum(title.startswith("ray::ServeReplica") for title in pids.values())
