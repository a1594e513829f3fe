"""What ``serving up`` set up around the integration stack's Ray head."""

from __future__ import annotations

from pathlib import Path

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
