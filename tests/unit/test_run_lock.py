"""One training job per model@version: a second one is refused while the first holds the lock, on
a local store (flock, freed when its holder dies) and on S3 (moto's server: a conditional lease)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from serving.registry import CheckpointStore
from training.run_lock import RunLocked, run_lock
from training.train import TrainingError, train


def test_a_local_lock_refuses_a_second_job_and_is_gone_after(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    with run_lock(store, "m", "v1"):
        with pytest.raises(RunLocked, match=r"another training job of m@v1 is running \(.* pid \d+ since "):
            with run_lock(store, "m", "v1"):
                pass
        with run_lock(store, "m", "v2"):  # another version trains at the same time
            pass
        # the job itself refuses before it reads data or starts Ray
        with pytest.raises(TrainingError, match="another training job of m@v1"):
            train("m", "v1", str(tmp_path), "init:llama-tiny", "builtin:add", steps=1)
    assert not (tmp_path / "m" / ".runs" / "v1.lock").exists()
    with run_lock(store, "m", "v1"):
        pass


def test_a_killed_holder_leaves_no_local_lock(tmp_path: Path) -> None:
    hold = (
        "import sys, time; from serving.registry import CheckpointStore; from training.run_lock import run_lock\n"
        f"with run_lock(CheckpointStore({str(tmp_path)!r}), 'm', 'v1'):\n"
        "    print('held', flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        with pytest.raises(RunLocked, match=f"pid {proc.pid} "):
            with run_lock(CheckpointStore(str(tmp_path)), "m", "v1"):
                pass
    finally:
        proc.kill()
        proc.wait(timeout=30)
    with run_lock(CheckpointStore(str(tmp_path)), "m", "v1"):  # the kernel dropped the dead job's lock
        pass


def test_an_s3_lease_refuses_a_second_job_until_released(s3_bucket: str) -> None:
    root = f"s3://{s3_bucket}/store"
    store = CheckpointStore(root)
    lease = f"{store.run_path('m', 'v1')}.lock/lock.json"
    with run_lock(store, "m", "v1", ttl_s=40):
        store.fs.invalidate_cache()
        assert store.fs.isfile(lease)
        started = time.time()
        with pytest.raises(RunLocked, match=r"another training job of m@v1 is running .* lapses in \d+s unless"):
            with run_lock(CheckpointStore(root), "m", "v1"):
                pass
        assert time.time() - started < 10
    store.fs.invalidate_cache()
    assert not store.fs.exists(lease)
    with run_lock(CheckpointStore(root), "m", "v1"):
        pass
