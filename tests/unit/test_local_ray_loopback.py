"""The environment of a local Ray (``LOCAL_RAY_LOOPBACK``) keeps torch's gloo on loopback. gloo binds
the address the host name resolves to, and a cloud VM's host name often resolves to its network
address (this machine's resolves to 127.0.0.1, so the check runs in a user and UTS namespace of
its own whose host name is a network address)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from serving.config import LOCAL_RAY_LOOPBACK

# one gloo rank; prints the addresses its process listens on
GLOO = """
import os, socket, tempfile, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
mine = set()
for fd in os.listdir("/proc/self/fd"):
    try:
        link = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        continue
    if link.startswith("socket:["):
        mine.add(link[8:-1])
for line in open("/proc/self/net/tcp").read().splitlines()[1:]:
    f = line.split()
    if f[3] == "0A" and f[9] in mine:
        print("LISTEN", socket.inet_ntoa(bytes.fromhex(f[1].split(":")[0])[::-1]))
"""


def _listening(env: dict[str, str]) -> set[str]:
    assert shutil.which("unshare"), "util-linux's unshare is needed for this test"
    script = f'hostname 192.0.2.2 && exec "{sys.executable}" -c "$GLOO_CHECK"'
    out = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--uts", "sh", "-c", script],
        env={**env, "GLOO_CHECK": GLOO},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return {line.split()[1] for line in out.stdout.splitlines() if line.startswith("LISTEN")}


def test_gloo_listens_on_loopback_in_a_local_rays_environment() -> None:
    plain = {k: v for k, v in os.environ.items() if not k.startswith(("GLOO_", "NCCL_"))}
    assert _listening(plain) == {"192.0.2.2"}  # what a host name on the network does by default
    assert _listening(plain | LOCAL_RAY_LOOPBACK) == {"127.0.0.1"}
