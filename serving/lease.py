"""A lease in a store folder: who holds something, until when. The promotion controller's lock
(one active controller per stack, ``<root>/.control/<stack>/lock.json``) and the training job's
run lock on an object store (one job per ``model@version``) are both one.

A lease is ``{holder, token, expires_at}`` in ``<folder>/lock.json``. A holder takes it when it is
absent, expired or its own, renews it before it expires and checks it before every write; one that
sees another holder's unexpired lease waits or gives up. Taking or renewing it is a
compare-and-set:

- on a local (or NFS) store, under an ``flock`` of ``<folder>/lock.flock``;
- on S3 (s3fs), a conditional write: ``If-None-Match: *`` creates the lease only if there is none,
  ``If-Match: <ETag read>`` replaces exactly the lease that was read, so of two clusters that read
  the same expired lease one write succeeds and the other gets 412;
- on another object store, which has no conditional write through fsspec, write then read back
  after a settle delay (the later writer wins and the earlier sees it lost).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

__all__ = ["LeaseFile", "LockLost", "StoreLock", "delete_file", "holder_name", "is_local", "read_file", "write_whole"]

log = logging.getLogger("raystack.lease")
T = TypeVar("T")
_MEMORY_MUTEX = threading.Lock()  # memory:// lives in this process: one lock serves every lease


def holder_name() -> str:
    """Who holds a lease, as its ``holder`` says: this host and process."""
    return f"{socket.gethostname()}:{os.getpid()}"


def is_local(fs: AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def read_file(fs: AbstractFileSystem, path: str) -> bytes | None:
    """The file's bytes as they are now (the listing cache dropped first), None when absent."""
    fs.invalidate_cache()
    try:
        return bytes(fs.cat_file(path))
    except FileNotFoundError:
        return None


def write_whole(fs: AbstractFileSystem, path: str, data: bytes) -> None:
    """Replace the file whole or not at all: a reader never sees half of it (locally a renamed
    temporary file; an object store's put is whole anyway)."""
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    if is_local(fs):
        tmp = f"{path}.tmp-{secrets.token_hex(4)}"
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    else:
        fs.pipe_file(path, data)


def delete_file(fs: AbstractFileSystem, path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(path)


class LockLost(Exception):
    """Another holder took the lease while this one was busy: it stops writing at once."""


class LeaseFile:
    """``lock.json`` in ``folder`` of the filesystem ``fs``: read, and written whole or only if
    unchanged since it was read."""

    def __init__(self, fs: AbstractFileSystem, folder: str) -> None:
        self.fs, self.folder = fs, folder.rstrip("/")
        self.path = f"{self.folder}/lock.json"

    @property
    def is_local(self) -> bool:
        """Whether a mutex makes the read and write one step: a local disk's ``flock``, or the
        process's own lock for fsspec's in-process ``memory://`` (tests and single-process use)."""
        return is_local(self.fs) or type(self.fs) is MemoryFileSystem

    @property
    def conditional(self) -> bool:
        """Whether writes can be made conditional on what was read (S3's If-Match/If-None-Match)."""
        return "s3" in tuple(self.fs.protocol)

    def where(self) -> str:
        """The lease's folder as a URI (for messages)."""
        return str(self.fs.unstrip_protocol(self.folder))

    @contextlib.contextmanager
    def mutex(self) -> Iterator[None]:
        """Held while a lease is read and written on a store without conditional writes (an
        ``flock`` on a local store; nothing on an object store: see the module docstring)."""
        if not self.is_local:
            yield
            return
        if type(self.fs) is MemoryFileSystem:
            with _MEMORY_MUTEX:
                yield
            return
        os.makedirs(self.folder, exist_ok=True)
        with open(f"{self.folder}/lock.flock", "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def read(self) -> dict[str, Any] | None:
        raw = read_file(self.fs, self.path)
        return None if raw is None else dict(json.loads(raw))

    def write(self, body: dict[str, Any]) -> None:
        write_whole(self.fs, self.path, json.dumps(body).encode())

    def delete(self) -> None:
        delete_file(self.fs, self.path)

    def read_tagged(self) -> tuple[dict[str, Any] | None, str | None]:
        """The lease and the ETag it was read under (``None, None`` when there is none).

        The ETag is read first: if the object changes before its body is read, the conditional
        write with the older ETag fails, which is the safe outcome."""
        try:
            etag = str(self.fs.info(self.path, refresh=True)["ETag"])
        except FileNotFoundError:
            return None, None
        return self.read(), etag

    def write_if(self, body: dict[str, Any], etag: str | None) -> bool:
        """Write the lease only if the object is still the one read under ``etag`` (``None``: only
        if there is none); False when another writer got there first."""
        data = json.dumps(body).encode()
        try:
            if etag is None:
                self.fs.pipe_file(self.path, data, mode="create")
            else:
                self.fs.pipe_file(self.path, data, IfMatch=etag)
        except (FileExistsError, FileNotFoundError):  # created, or deleted, since it was read
            return False
        except OSError as exc:  # s3fs raises 412 Precondition Failed as EINVAL
            if exc.errno == errno.EINVAL:
                return False
            raise
        return True


class StoreLock:
    """One holder's side of a lease (see the module docstring)."""

    def __init__(
        self,
        lease: LeaseFile,
        holder: str,
        ttl_s: float,
        clock: Callable[[], float] = time.time,
        settle_s: float = 1.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.lease, self.holder, self.ttl_s = lease, holder, ttl_s
        self.clock, self.settle_s, self.sleep = clock, settle_s, sleep
        self.token = secrets.token_hex(8)
        self._renewed_at = -math.inf  # self.clock() before the last read that took or renewed it

    def _claim(self, current: dict[str, Any] | None, renew: bool = False) -> dict[str, Any] | None:
        """The lease to write over ``current``, or None while another holder's has not expired
        (with ``renew``: unless ``current`` is this holder's own, expired or not)."""
        now = self.clock()
        ours = current is not None and current.get("token") == self.token
        if renew and not ours:
            return None
        if current and not ours and float(current.get("expires_at", 0)) > now:
            return None
        return {"holder": self.holder, "token": self.token, "expires_at": now + self.ttl_s}

    def acquire(self, renew: bool = False) -> bool:
        """Take or renew the lease; False if another holder's lease has not expired. With
        ``renew``, only renew it: False unless the lease is still this holder's (had another
        holder taken it meanwhile, it may have acted on what this one is about to write)."""
        started = self.clock()
        if self.lease.conditional:
            current, etag = self.lease.read_tagged()
            body = self._claim(current, renew)
            taken = body is not None and self.lease.write_if(body, etag)
        else:
            with self.lease.mutex():
                body = self._claim(self.lease.read(), renew)
                if body is None:
                    return False
                self.lease.write(body)
            if not self.lease.is_local:  # no mutex: the last writer wins, so look again
                self.sleep(self.settle_s)
            taken = self.held()
        if taken:
            self._renewed_at = started
        return taken

    def ensure(self, what: str) -> None:
        """Before a write only the holder may make (``what``): renew the lease once a third of its
        time has passed since the last renewal, so a holder slowed down between two writes (slow
        metric reads, a slow API server) never writes on a lease that may have expired. Raises
        :class:`LockLost` when another holder has it, or when the renewal failed and less than a
        third of the lease may be left."""
        age = self.clock() - self._renewed_at
        if age < self.ttl_s / 3:
            return
        try:
            held = self.acquire(renew=True)
        except OSError as exc:
            if age < self.ttl_s * 2 / 3:
                log.warning("renewing the lock before %s: %s; still held", what, exc)
                return
            raise LockLost(f"could not renew the lock before {what}: {exc}") from None
        if not held:
            raise LockLost(f"lost the lock before {what}") from None

    def held(self) -> bool:
        current = self.lease.read()
        return bool(current and current.get("token") == self.token and float(current["expires_at"]) > self.clock())

    def release(self) -> None:
        if self.lease.conditional:  # expire it, only if it is still ours
            current, etag = self.lease.read_tagged()
            if current and current.get("token") == self.token:
                self.lease.write_if(current | {"expires_at": 0.0}, etag)
            return
        with self.lease.mutex():
            if self.held():
                self.lease.delete()

    def hold_while(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a thread, while this holder keeps renewing the lease so that nobody
        takes it meanwhile (hashing a large model, an online eval of slow prompts, a warm-up). A
        lease lost anyway raises :class:`LockLost`. A renewal the store fails (a 503, a network
        error) is tried again at the next interval; once the lease may have expired without one,
        it counts as lost."""
        self.ensure(what)
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="holding-lock")
        renewed = time.monotonic() - max(0.0, self.clock() - self._renewed_at)  # the last renewal
        try:
            job = pool.submit(fn, *args)
            while True:
                try:
                    return job.result(timeout=max(0.05, self.ttl_s / 3))
                except concurrent.futures.TimeoutError:
                    try:
                        held = self.acquire(renew=True)
                    except OSError as exc:
                        if time.monotonic() - renewed < self.ttl_s:
                            log.warning("renewing the lock while %s: %s; trying again", what, exc)
                            continue
                        raise LockLost(f"could not renew the lock while {what}: {exc}") from None
                    if not held:
                        raise LockLost(f"lost the lock while {what}") from None
                    renewed = time.monotonic()
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
