"""Publishing onto an object store (fsspec's ``memory://``, which takes the same path as S3): one
publisher per name, a publish that died part way does not take the name for good, files move by
their exact keys; and imports from a URI keep to a folder's rules (serving/store_move.py,
serving/control/importer.py)."""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from serving import store_move
from serving.control.importer import ImportFailed, import_model
from serving.registry import CheckpointStore, VersionExists
from tests.unit.test_registry import fake_checkpoint, fields

_roots = itertools.count()


@pytest.fixture
def store() -> Iterator[CheckpointStore]:
    s = CheckpointStore(f"memory://publish-test-{os.getpid()}-{next(_roots)}")
    yield s
    if s.fs.exists(s.root):
        s.fs.rm(s.root, recursive=True)


def test_file_names_with_glob_characters_land_at_their_own_keys(store: CheckpointStore, tmp_path: Path) -> None:
    src = fake_checkpoint(tmp_path / "src")
    (src / "model-*.safetensors").write_bytes(b"a" * 10)
    (src / "tok[x].json").write_text("{}")
    (src / "tokx.json").write_text('{"other": 1}')
    store.publish(src, fields("adder", "v1"))
    assert store.list_versions("adder") == ["v1"]
    store.verify("adder", "v1")  # every file where the manifest says, with its hash


def test_a_publish_that_died_part_way_leaves_the_name_free(
    store: CheckpointStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = fake_checkpoint(tmp_path / "src")
    copy, calls = MemoryFileSystem.cp_file, []

    def flaky(self: Any, path1: str, path2: str, **kwargs: Any) -> Any:
        calls.append(path2)
        if "/adder/v1/" in path2 and len([c for c in calls if "/adder/v1/" in c]) == 2:
            raise ConnectionError("connection reset")
        return copy(self, path1, path2, **kwargs)

    monkeypatch.setattr(MemoryFileSystem, "cp_file", flaky)
    with pytest.raises(ConnectionError):
        store.publish(src, fields("adder", "v1"))
    assert store.list_versions("adder") == [] and not store.exists("adder", "v1")
    store.publish(src, fields("adder", "v1"))  # the next publish removes what the dead one left
    assert store.list_versions("adder") == ["v1"]
    store.verify("adder", "v1")


def test_two_publishers_of_one_name_one_wins_and_its_files_are_whole(
    store: CheckpointStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both have uploaded their files when they start moving them; as on S3, a key lands some
    milliseconds after it is sent and there are no folders (nothing shows a version being moved in
    until its first file has landed)."""
    sources = [fake_checkpoint(tmp_path / name) for name in ("a", "b")]
    (sources[1] / "model.safetensors").write_bytes(b"\x02other\x03" * 100)
    start, outcomes = threading.Barrier(2), []
    into_place, cp_file, mv = CheckpointStore._rename_into_place, MemoryFileSystem.cp_file, MemoryFileSystem.mv

    def together(self: CheckpointStore, *args: Any) -> None:
        start.wait(timeout=30)
        into_place(self, *args)

    def slow(copy: Any) -> Any:
        def landing(self: Any, path1: str, path2: str, **kwargs: Any) -> Any:
            time.sleep(0.02)
            return copy(self, path1, path2, **kwargs)

        return landing

    monkeypatch.setattr(CheckpointStore, "_rename_into_place", together)
    monkeypatch.setattr(MemoryFileSystem, "cp_file", slow(cp_file))
    monkeypatch.setattr(MemoryFileSystem, "mv", slow(mv))
    monkeypatch.setattr(MemoryFileSystem, "makedirs", lambda self, path, exist_ok=False: None)

    def publish(src: Path) -> None:
        try:
            outcomes.append(store.publish(src, fields("adder", "v1")).files["model.safetensors"])
        except VersionExists as exc:
            outcomes.append(str(exc))

    threads = [threading.Thread(target=publish, args=(s,)) for s in sources]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    won = [o for o in outcomes if "already exists" not in o and "appeared while publishing" not in o]
    assert len(outcomes) == 2 and len(won) == 1, outcomes
    assert store.verify("adder", "v1").files["model.safetensors"] == won[0]  # the winner's files, all of them


def test_a_name_another_publisher_holds_is_refused_after_the_wait(store: CheckpointStore, tmp_path: Path) -> None:
    from serving.lease import LeaseFile, StoreLock

    other = StoreLock(LeaseFile(store.fs, f"{store.root}/adder/{store_move.PUBLISH_DIR}/v1"), "other", 60)
    assert other.acquire()
    tmp = f"{store.root}/adder/.tmp-v1-x"
    store.fs.pipe_file(f"{tmp}/manifest.json", b"{}")
    why = store_move.move_into_place(store.fs, tmp, f"{store.root}/adder/v1", ["manifest.json"], "adder@v1", 0)
    assert why == "adder@v1 is being published by another job (its lease did not lapse in 0s)"
    assert not store.exists("adder", "v1")


def test_a_file_uri_import_refuses_a_link_out_of_the_folder(store: CheckpointStore, tmp_path: Path) -> None:
    src = fake_checkpoint(tmp_path / "hf")
    (tmp_path / "secret").write_text("PRIVATE KEY")
    (src / "model.safetensors").unlink()
    (src / "model.safetensors").symlink_to(tmp_path / "secret")
    with pytest.raises(ImportFailed, match="model.safetensors points outside the folder"):
        import_model(f"file://{src}", store, "m", "v1", log=lambda _: None)
    assert store.list_versions("m") == []


def test_a_uri_import_skips_an_object_stores_folder_markers(
    store: CheckpointStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """s3fs lists the zero-byte ``prefix/`` keys that consoles and sync tools create as folders."""
    up = CheckpointStore(f"{store.root}-up")
    src = fake_checkpoint(tmp_path / "hf")
    for path in src.rglob("*"):
        if path.is_file():
            up.fs.pipe_file(f"{up.root}/llama/{path.relative_to(src).as_posix()}", path.read_bytes())
    find = MemoryFileSystem.find

    def with_markers(self: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        found = find(self, path, *args, **kwargs)
        return [f"{path.rstrip('/')}/", f"{path.rstrip('/')}/tokenizer/", *found] if isinstance(found, list) else found

    monkeypatch.setattr(MemoryFileSystem, "find", with_markers)
    manifest = import_model(f"{up.root}/llama", store, "m", "v1", log=lambda _: None)
    monkeypatch.undo()
    assert sorted(manifest.files) == ["config.json", "model.safetensors", "tokenizer/tokenizer.json"]
    up.fs.rm(up.root, recursive=True)
