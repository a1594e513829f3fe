"""Run ``uv pip ARGS`` for this Python's environment, from the package sources pip is set up with.

``make install`` installs with uv: the project's ~250 packages install in about 30 s instead of
pip's 105 s (a fresh venv on the 2-core VM, 2026-12-04, the same versions to the last package),
with their bytecode compiled (``--compile-bytecode``, as pip does by default): where
``PYTHONDONTWRITEBYTECODE`` is set, as on this project's machines, nothing else would ever write
it, and every process would compile torch, transformers, Ray and vLLM again as it imports them
(12 s against 4.7 s for those imports).
uv reads none of pip's configuration, by design, so a machine whose pip finds packages through a
local wheel folder, extra indexes or a constraints file (pip.conf, PIP_* variables) would send uv
elsewhere and, for vLLM's CPU torch, find nothing. This reads ``pip config list`` (every scope,
the environment included) and hands the same sources to uv: indexes and wheel folders in a uv
config file of mode 0600 that lives only as long as the command (index URLs may carry
credentials, so never on a command line, which ``ps`` shows every local user), constraint files
as ``--constraint``, with pip's choice of the best version across all indexes
(``unsafe-best-match``). Run it with the venv's Python, which has uv installed beside it.
Standard library only: it runs before the project is installed.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

SETTINGS = ("index-url", "extra-index-url", "find-links", "constraint")  # pip's names, and uv's


def pip_sources(pip_config: str) -> dict[str, list[str]]:
    """Values of pip's source settings, from the lines of ``pip config list``
    (``scope.key='value'``, several values space-separated), first seen first, once each."""
    found: dict[str, list[str]] = {}
    for line in pip_config.splitlines():
        key, sep, raw = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        if not sep or name not in SETTINGS:
            continue
        for value in " ".join(shlex.split(raw)).split():
            if value not in found.setdefault(name, []):
                found[name].append(value)
    return found


def uv_config(sources: dict[str, list[str]]) -> str:
    """A uv.toml ``[pip]`` table with those sources (TOML strings are JSON strings here)."""
    lines = ["[pip]", 'index-strategy = "unsafe-best-match"']
    if sources.get("index-url"):
        lines.append(f"index-url = {json.dumps(sources['index-url'][0])}")
    for name in ("extra-index-url", "find-links"):
        if sources.get(name):
            lines.append(f"{name} = {json.dumps(sources[name])}")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    sources = pip_sources(listed)
    uv = Path(sys.executable).with_name("uv")
    constraints = [arg for path in sources.get("constraint", []) for arg in ("--constraint", path)]
    with tempfile.TemporaryDirectory(prefix="uv-sources-") as directory:
        config = Path(directory) / "uv.toml"
        config.touch(mode=0o600)
        config.write_text(uv_config(sources))
        env = {**os.environ, "UV_CONFIG_FILE": str(config)}
        cmd = [str(uv), "pip", *argv[:1], "--python", sys.executable, *argv[1:]]
        cmd += constraints if argv[:1] == ["install"] else []
        return subprocess.run(cmd, env=env, check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
