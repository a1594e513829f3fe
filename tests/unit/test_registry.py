"""Checkpoint store: listing, verification, error tree and publishing, on fake files (no Ray)."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from pydantic import ValidationError

from serving.manifest import Evaluation, Manifest
from serving.node_cache import VerifiedCache
from serving.registry import (
    BelowEvalGate,
    CheckpointStore,
    Gate,
    IncompleteVersion,
    RegistryError,
    TamperedVersion,
    VersionExists,
    VersionNotFound,
)

_counter = itertools.count()


def fields(model: str, version: str, score: float = 0.97, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "version": version,
        "base": {"source": "init", "ref": "init:llama-tiny"},
        "eval": {"metrics": {"exact_match": score}, "n": 500},
        "code_revision": "unknown",
        **extra,
    }


def put(store: CheckpointStore, path: str, data: bytes) -> None:
    store.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    store.fs.pipe_file(path, data)


def fake_checkpoint(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text('{"model_type": "llama"}')
    (directory / "model.safetensors").write_bytes(b"\x00weights\x01" * 100)
    (directory / "tokenizer").mkdir(exist_ok=True)
    (directory / "tokenizer" / "tokenizer.json").write_text("{}")
    return directory


@pytest.fixture(params=["local", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CheckpointStore]:
    if request.param == "local":
        yield CheckpointStore(str(tmp_path / "store"))
        return
    root = f"memory://registry-test-{next(_counter)}"
    yield CheckpointStore(root)
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


@pytest.fixture
def published(store: CheckpointStore, tmp_path: Path) -> CheckpointStore:
    src = fake_checkpoint(tmp_path / "src")
    for version, score in [("v1", 0.97), ("v2", 0.5), ("v10", 0.99)]:
        store.publish(src, fields("adder", version, score))
    store.publish(src, fields("subber", "v1", 0.95, parent_version=None, task="sub"))
    return store


def test_publish_writes_layout_and_manifest(published: CheckpointStore) -> None:
    fs, path = published.fs, published.version_path("adder", "v1")
    names = sorted(p[len(path) + 1 :] for p in fs.find(path))
    assert names == ["config.json", "manifest.json", "model.safetensors", "tokenizer/tokenizer.json"]
    raw = json.loads(fs.cat_file(f"{path}/manifest.json"))
    assert set(raw["files"]) == {"config.json", "model.safetensors", "tokenizer/tokenizer.json"}
    assert raw["created_at"].endswith("Z")
    assert not [p for p in fs.find(published._join("adder")) if "/.tmp-" in p]


def test_listing(published: CheckpointStore) -> None:
    assert published.list_models() == ["adder", "subber"]
    assert published.list_versions("adder") == ["v1", "v2", "v10"]
    assert published.list_versions("nobody") == []


def test_listing_ignores_partial_runs_and_tmp_dirs(published: CheckpointStore) -> None:
    put(published, published._join("adder", ".tmp-v3-abcd", "model.safetensors"), b"partial")
    put(published, published._join("adder", ".runs", "v3", "job.json"), b"{}")
    put(published, published._join("adder", "v4", "config.json"), b"{}")  # no manifest
    put(published, published._join("ghost", ".runs", "v1", "job.json"), b"{}")
    assert published.list_versions("adder") == ["v1", "v2", "v10"]
    assert published.list_models() == ["adder", "subber"]
    with pytest.raises(IncompleteVersion, match="no manifest.json"):
        published.verify("adder", "v4")


def test_manifest_and_verify_ok(published: CheckpointStore) -> None:
    manifest = published.manifest("adder", "v10")
    assert isinstance(manifest, Manifest)
    assert (manifest.model, manifest.version, manifest.eval and manifest.eval.metrics["exact_match"]) == (
        "adder",
        "v10",
        0.99,
    )
    assert published.verify("adder", "v10", Gate(metric="exact_match", min=0.9)) == manifest


def test_extra_manifest_fields_are_kept(store: CheckpointStore, tmp_path: Path) -> None:
    src = fake_checkpoint(tmp_path / "src")
    store.publish(src, fields("adder", "v1", seed=7, wall_s=12.5))
    manifest = store.verify("adder", "v1")
    assert manifest.model_extra == {"seed": 7, "wall_s": 12.5}


def test_missing_version(published: CheckpointStore) -> None:
    with pytest.raises(VersionNotFound, match="adder@v9 not found") as info:
        published.verify("adder", "v9")
    assert isinstance(info.value, RegistryError)
    assert (info.value.model, info.value.version) == ("adder", "v9")
    with pytest.raises(VersionNotFound):
        published.manifest("nobody", "v1")


def test_invalid_manifest(published: CheckpointStore) -> None:
    path = published.version_path("adder", "v1")
    published.fs.pipe_file(f"{path}/manifest.json", b'{"model": "adder"}')
    with pytest.raises(IncompleteVersion, match="invalid manifest.json"):
        published.verify("adder", "v1")
    published.fs.pipe_file(f"{path}/manifest.json", b"not json")
    with pytest.raises(IncompleteVersion):
        published.manifest("adder", "v1")


def test_manifest_of_another_version(published: CheckpointStore) -> None:
    src = published.version_path("adder", "v1")
    dst = published.version_path("adder", "v2")
    published.fs.pipe_file(f"{dst}/manifest.json", published.fs.cat_file(f"{src}/manifest.json"))
    with pytest.raises(TamperedVersion, match="describes adder@v1"):
        published.verify("adder", "v2")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("modify", "file model.safetensors does not match its sha256"),
        ("delete", "file tokenizer/tokenizer.json is listed in the manifest but missing"),
        ("extra", "file model-00002.safetensors is not listed in the manifest"),
    ],
)
def test_tampered(published: CheckpointStore, change: str, message: str) -> None:
    fs, path = published.fs, published.version_path("adder", "v1")
    if change == "modify":
        fs.pipe_file(f"{path}/model.safetensors", b"\x00weights\x02" * 100)
    elif change == "delete":
        fs.rm(f"{path}/tokenizer/tokenizer.json")
    else:
        fs.pipe_file(f"{path}/model-00002.safetensors", b"more weights")
    with pytest.raises(TamperedVersion, match=message):
        published.verify("adder", "v1")
    published.verify("adder", "v10")  # other versions unaffected


def test_below_eval_gate(published: CheckpointStore) -> None:
    expected = r"adder@v2: exact_match 0\.5000 \(n=500\) is below the gate 0\.9000"
    with pytest.raises(BelowEvalGate, match=expected):
        published.verify("adder", "v2", Gate(metric="exact_match", min=0.9))
    assert published.verify("adder", "v2", Gate(metric="exact_match", min=0.5)).eval == Evaluation(
        metrics={"exact_match": 0.5}, n=500
    )
    assert published.verify("adder", "v2").version == "v2"  # no gate


def test_publish_refuses_to_overwrite(published: CheckpointStore, tmp_path: Path) -> None:
    before = published.fs.cat_file(published.version_path("adder", "v1") + "/manifest.json")
    other = tmp_path / "other"
    fake_checkpoint(other)
    (other / "model.safetensors").write_bytes(b"different")
    with pytest.raises(VersionExists, match="adder@v1 already exists"):
        published.publish(other, fields("adder", "v1"))
    after = published.fs.cat_file(published.version_path("adder", "v1") + "/manifest.json")
    assert before == after
    published.verify("adder", "v1")


def test_invalid_names_are_rejected(store: CheckpointStore, tmp_path: Path) -> None:
    src = fake_checkpoint(tmp_path / "src")
    for bad in ["../escape", ".runs", ".tmp-v1", "a/b", ""]:
        with pytest.raises(ValueError, match="invalid version name"):
            store.publish(src, fields("adder", bad))
    with pytest.raises(ValueError, match="invalid model name"):
        store.list_versions("../x")


@pytest.mark.parametrize("bad", ["../x", "/x", "a//b", "a/./b", "a/..", "manifest.json", "a\\b", ""])
def test_manifest_file_names_are_paths_inside_the_version(bad: str) -> None:
    body = {"model": "adder", "version": "v1", "created_at": "2026-12-01T00:00:00Z"}
    ok = {"config.json": "0" * 64, "tokenizer/tokenizer.json": "1" * 64, ".gitattributes": "2" * 64}
    assert set(Manifest.model_validate({**body, "files": ok}).files) == set(ok)
    for field, value in [("files", "0" * 64), ("sizes", 1)]:
        with pytest.raises(ValidationError, match=f"invalid file name {re.escape(repr(bad))}"):
            Manifest.model_validate({**body, "files": {"config.json": "0" * 64}, field: {bad: value}})


def test_publish_refuses_symlinked_folders_and_dangling_links(store: CheckpointStore, tmp_path: Path) -> None:
    """What publish hashes is what it copies: a link it could not copy is refused, not left out."""
    src = fake_checkpoint(tmp_path / "src")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "extra.json").write_text("{}")
    (src / "more").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(ValueError, match=r"src/more is a symlinked folder"):
        store.publish(src, fields("adder", "v1"))
    (src / "more").unlink()
    (src / "model-00002.safetensors").symlink_to(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"src/model-00002.safetensors is a dangling symlink"):
        store.publish(src, fields("adder", "v1"))
    assert not store.exists("adder", "v1")


def test_a_verified_local_copy(published: CheckpointStore, tmp_path: Path) -> None:
    cache = VerifiedCache(tmp_path / "cache")
    path = Path(cache.resolve(published, "adder", "v1").path)
    assert (path / "model.safetensors").read_bytes() == b"\x00weights\x01" * 100
    assert (path / "tokenizer" / "tokenizer.json").is_file()
    if published.is_local:
        assert str(path) == published.version_path("adder", "v1")
    else:
        assert path.is_relative_to(tmp_path / "cache")
        assert cache.resolve(published, "adder", "v1").path == str(path)  # cached
        assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp-")]
    with pytest.raises(VersionNotFound):
        cache.resolve(published, "adder", "v9")


def test_a_tampered_download_is_refused(tmp_path: Path) -> None:
    store = CheckpointStore(f"memory://registry-test-{next(_counter)}")
    store.publish(fake_checkpoint(tmp_path / "src"), fields("adder", "v1"))
    store.fs.pipe_file(store.version_path("adder", "v1") + "/config.json", b"{}")
    with pytest.raises(TamperedVersion, match="config.json"):
        VerifiedCache(tmp_path / "c").resolve(store, "adder", "v1")
    assert not list((tmp_path / "c").rglob("manifest.json"))


def test_created_at_is_the_manifest_time_and_zero_without_one(published: CheckpointStore) -> None:
    from serving.registry import created_at

    man = published.manifest("adder", "v1")
    assert created_at(published.uri("adder", "v1")) == int(man.created_at.timestamp()) > 0
    assert created_at(published.uri("adder", "v99")) == 0
