"""The node-local verified cache on a local store and on a real S3 API (moto's server on loopback).

Tampering is done the way an outsider would: straight through boto3 (or the local disk), behind
the back of the s3fs instance the store uses, so a stale listing cache would show.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from serving import registry
from serving.node_cache import VerifiedCache, split_version_uri
from serving.registry import CheckpointStore, IncompleteVersion, RegistryError, TamperedVersion
from tests.unit.test_registry import fake_checkpoint, fields


@pytest.fixture
def hashes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every file the cache hashes (the expensive read), in order."""
    seen: list[str] = []
    real = registry.sha256_file

    def counting(path: str | Path) -> str:
        seen.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(registry, "sha256_file", counting)
    return seen


@pytest.fixture
def s3_store(s3_bucket: str, tmp_path: Path) -> CheckpointStore:
    store = CheckpointStore(f"s3://{s3_bucket}/store")
    store.publish(fake_checkpoint(tmp_path / "src"), fields("adder", "v1"))
    return store


@pytest.fixture
def memory_store(tmp_path: Path) -> Iterator[CheckpointStore]:
    store = CheckpointStore(f"memory://node-cache-{tmp_path.name}")
    store.publish(fake_checkpoint(tmp_path / "src"), fields("adder", "v1"))
    yield store
    store.fs.rm(store.root, recursive=True)


def _boto() -> Any:
    import boto3

    return boto3.client("s3")


def _leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.rglob("*") if p.name.startswith(".tmp-") or p.name.endswith(".verified.json"))


def test_split_version_uri() -> None:
    assert split_version_uri("s3://b/store/adder/v1/") == ("s3://b/store", "adder", "v1")
    assert split_version_uri("/ck/adder/v1") == ("/ck", "adder", "v1")
    for bad in ("adder/v1", "s3://adder/v1", "/ck/adder/.runs"):
        with pytest.raises(ValueError):
            split_version_uri(bad)


def test_s3_publish_list_verify(s3_store: CheckpointStore) -> None:
    assert s3_store.list_models() == ["adder"]
    assert s3_store.list_versions("adder") == ["v1"]
    manifest = s3_store.verify("adder", "v1")
    assert manifest.sizes["model.safetensors"] == 900


def test_s3_fetch_once_then_cheap_check(s3_store: CheckpointStore, tmp_path: Path, hashes: list[str]) -> None:
    cache = VerifiedCache(tmp_path / "cache")
    first = cache.resolve(s3_store, "adder", "v1")
    assert first.action == "downloaded" and first.hashed_files == 3
    local = Path(first.path)
    assert local.is_relative_to(tmp_path / "cache")
    assert sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()) == [
        "config.json",
        "manifest.json",
        "model.safetensors",
        "tokenizer/tokenizer.json",
    ]
    assert sorted(hashes) == ["config.json", "model.safetensors", "tokenizer.json"]
    hashes.clear()
    again = VerifiedCache(tmp_path / "cache").resolve_uri(s3_store.uri("adder", "v1"))
    assert (again.action, again.path, again.hashed_files, hashes) == ("cached", first.path, 0, [])

    # a rewrite that puts the size and mtime back still changes the file's change time: the copy
    # is fetched and verified again, and whole again; so is one of another size
    weights = local / "model.safetensors"
    for size in (None, 10):
        st = weights.stat()
        weights.write_bytes(b"\xff" * (size or st.st_size))
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
        healed = cache.resolve(s3_store, "adder", "v1")
        assert healed.action == "downloaded" and healed.path == first.path
        assert registry.sha256_file(weights) == healed.manifest.files["model.safetensors"]
    assert cache.resolve(s3_store, "adder", "v1").action == "cached"


def test_s3_tampered_object_refused(s3_store: CheckpointStore, tmp_path: Path) -> None:
    bucket, key = s3_store.version_path("adder", "v1").split("/", 1)
    _boto().put_object(Bucket=bucket, Key=f"{key}/model.safetensors", Body=b"\x00evil!!!\x01" * 100)  # same size
    with pytest.raises(TamperedVersion, match=r"adder@v1: file model.safetensors does not match its sha256"):
        VerifiedCache(tmp_path / "cache").resolve(s3_store, "adder", "v1")
    assert _leftovers(tmp_path / "cache") == []  # nothing half-verified is left to load


def test_s3_partial_version_refused_before_download(
    s3_store: CheckpointStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3_store.list_versions("adder")  # fill s3fs's listing cache, then delete behind its back
    bucket, key = s3_store.version_path("adder", "v1").split("/", 1)
    _boto().delete_object(Bucket=bucket, Key=f"{key}/tokenizer/tokenizer.json")
    gets: list[str] = []
    monkeypatch.setattr(type(s3_store.fs), "get_file", lambda self, src, dst, **kw: gets.append(src))
    with pytest.raises(TamperedVersion, match="file tokenizer/tokenizer.json is listed in the manifest but missing"):
        VerifiedCache(tmp_path / "cache").resolve(s3_store, "adder", "v1")
    assert gets == []


def test_s3_unlisted_object_refused(s3_store: CheckpointStore, tmp_path: Path) -> None:
    bucket, key = s3_store.version_path("adder", "v1").split("/", 1)
    _boto().put_object(Bucket=bucket, Key=f"{key}/extra.safetensors", Body=b"more weights")
    with pytest.raises(TamperedVersion, match="file extra.safetensors is not listed"):
        VerifiedCache(tmp_path / "cache").resolve(s3_store, "adder", "v1")


def test_s3_changed_manifest_is_verified_anew(s3_store: CheckpointStore, tmp_path: Path) -> None:
    cache = VerifiedCache(tmp_path / "cache")
    first = cache.resolve(s3_store, "adder", "v1")
    path = s3_store.version_path("adder", "v1")
    raw = json.loads(s3_store.fs.cat_file(f"{path}/manifest.json"))
    raw["files"]["config.json"] = "0" * 64
    bucket, key = path.split("/", 1)
    _boto().put_object(Bucket=bucket, Key=f"{key}/manifest.json", Body=json.dumps(raw).encode())
    with pytest.raises(TamperedVersion, match="file config.json does not match"):
        cache.resolve(s3_store, "adder", "v1")
    assert Path(first.path).is_dir()  # the copy verified for the old manifest is not reused for it


def test_s3_concurrent_fetches_download_once(s3_store: CheckpointStore, tmp_path: Path) -> None:
    results: list[str] = []
    barrier = threading.Barrier(3)

    def fetch() -> None:
        barrier.wait()
        store = CheckpointStore(s3_store.root)
        results.append(VerifiedCache(tmp_path / "cache").resolve(store, "adder", "v1").action)

    threads = [threading.Thread(target=fetch) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(results) == ["cached", "cached", "downloaded"]


def test_local_store_verified_in_place_once(tmp_path: Path, hashes: list[str]) -> None:
    store = CheckpointStore(str(tmp_path / "store"))
    store.publish(fake_checkpoint(tmp_path / "src"), fields("adder", "v1"))
    hashes.clear()  # publishing hashed them too
    cache = VerifiedCache(tmp_path / "cache")
    first = cache.resolve(store, "adder", "v1")
    assert (first.action, first.path) == ("verified", store.version_path("adder", "v1"))
    assert len(hashes) == 3 and not list((tmp_path / "cache").rglob("model.safetensors"))  # no copy
    hashes.clear()
    assert cache.resolve(store, "adder", "v1").action == "cached" and hashes == []
    weights = Path(first.path) / "model.safetensors"
    weights.write_bytes(weights.read_bytes() + b"x")  # a changed size: hashed again, refused
    with pytest.raises(TamperedVersion, match="adder@v1: file model.safetensors is 901 bytes, the manifest says 900"):
        cache.resolve(store, "adder", "v1")


def test_object_key_outside_the_version_never_leaves_the_cache(memory_store: CheckpointStore, tmp_path: Path) -> None:
    """Object stores accept ``v1/../../../../escaped.py``: listed in the manifest with its true
    sha256 and size, it would be written four levels above the download, outside the cache."""
    path = memory_store.version_path("adder", "v1")
    evil = b"import os  # runs wherever it lands\n"
    memory_store.fs.pipe_file(f"{path}/../../../../escaped.py", evil)
    good = memory_store.fs.cat_file(f"{path}/manifest.json")
    raw = json.loads(good)
    raw["files"]["../../../../escaped.py"] = hashlib.sha256(evil).hexdigest()
    raw["sizes"]["../../../../escaped.py"] = len(evil)
    memory_store.fs.pipe_file(f"{path}/manifest.json", json.dumps(raw).encode())
    cache = VerifiedCache(tmp_path / "cache")
    named = re.escape("invalid file name '../../../../escaped.py'")
    with pytest.raises(RegistryError, match=named):
        cache.resolve(memory_store, "adder", "v1")
    with pytest.raises(RegistryError, match=named):
        memory_store.verify("adder", "v1")
    # the manifest restored, the object is still listed: refused before anything is fetched
    memory_store.fs.pipe_file(f"{path}/manifest.json", good)
    with pytest.raises(TamperedVersion, match=f"adder@v1: the store lists {named}"):
        cache.resolve(memory_store, "adder", "v1")
    assert not list(tmp_path.rglob("escaped.py")) and _leftovers(tmp_path / "cache") == []


def test_file_replaced_while_hashed_is_not_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A local store on a shared volume: the weights are rewritten (same size) right after they
    were hashed. The marker must not vouch for the new bytes."""
    store = CheckpointStore(str(tmp_path / "store"))
    store.publish(fake_checkpoint(tmp_path / "src"), fields("adder", "v1"))
    real = registry.sha256_file

    def hash_then_replace(path: str | Path) -> str:
        digest = real(path)
        if Path(path).name == "model.safetensors":
            st = Path(path).stat()
            Path(path).write_bytes(b"\xffevil\xff!!!" * 100)  # 900 bytes, like the weights
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        return digest

    monkeypatch.setattr(registry, "sha256_file", hash_then_replace)
    cache = VerifiedCache(tmp_path / "cache")
    with pytest.raises(TamperedVersion, match="adder@v1: file model.safetensors changed while it was hashed"):
        cache.resolve(store, "adder", "v1")
    monkeypatch.setattr(registry, "sha256_file", real)
    with pytest.raises(TamperedVersion, match="file model.safetensors does not match its sha256"):
        cache.resolve(store, "adder", "v1")


def test_marker_is_not_trusted_for_a_size_other_than_the_manifests(tmp_path: Path) -> None:
    """A marker that records a file the manifest does not describe (as one written from stats taken
    after the hashing could) sends the file back to the full check."""
    store = CheckpointStore(str(tmp_path / "store"))
    store.publish(fake_checkpoint(tmp_path / "src"), fields("adder", "v1"))
    cache = VerifiedCache(tmp_path / "cache")
    weights = Path(cache.resolve(store, "adder", "v1").path) / "model.safetensors"
    weights.write_bytes(b"\xff" * 10)
    (marker,) = (tmp_path / "cache").rglob("*.verified.json")
    body = json.loads(marker.read_text())
    st = weights.stat()
    body["files"]["model.safetensors"] = {
        "size": 10,
        "mtime_ns": st.st_mtime_ns,
        "ino": st.st_ino,
        "ctime_ns": st.st_ctime_ns,
    }
    marker.write_text(json.dumps(body))
    with pytest.raises(TamperedVersion, match="file model.safetensors is 10 bytes, the manifest says 900"):
        cache.resolve(store, "adder", "v1")


def test_partial_download_of_a_dead_process_is_removed(memory_store: CheckpointStore, tmp_path: Path) -> None:
    cache = VerifiedCache(tmp_path / "cache")
    copy = Path(cache.resolve(memory_store, "adder", "v1").path)
    stale = copy.parent / f".tmp-{copy.name}-dead0001"  # a replica killed mid-fetch
    (stale / "tokenizer").mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"\x00weights")
    (copy / "model.safetensors").write_bytes(b"\xff" * 10)  # fails the cheap check: fetched again
    assert cache.resolve(memory_store, "adder", "v1").action == "downloaded"
    assert not stale.exists() and _leftovers(tmp_path / "cache") == [f"{copy.name}.verified.json"]


def test_local_store_without_manifest_refused(tmp_path: Path) -> None:
    fake_checkpoint(tmp_path / "store" / "bench" / "tiny")
    with pytest.raises(IncompleteVersion, match="bench@tiny has no manifest.json"):
        VerifiedCache(tmp_path / "cache").resolve_uri(str(tmp_path / "store" / "bench" / "tiny"))


def test_cache_dir_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYSTACK_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert VerifiedCache().dir == tmp_path / "elsewhere"


def test_replica_spec_resolves_through_the_cache(
    s3_store: CheckpointStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from serving.config import EngineConfig
    from serving.replica.engine import EngineSpec, WeightsRefused, verified_spec

    monkeypatch.setenv("RAYSTACK_CACHE_DIR", str(tmp_path / "node"))
    spec = EngineSpec(model="m", version="v1", path=s3_store.uri("adder", "v1"), engine=EngineConfig())
    local = verified_spec(spec)
    assert Path(local.path).is_relative_to(tmp_path / "node") and local.model_copy(update={"path": spec.path}) == spec
    bucket, key = s3_store.version_path("adder", "v1").split("/", 1)
    _boto().put_object(Bucket=bucket, Key=f"{key}/config.json", Body=b'{"model_type": "llamb"}')
    assert verified_spec(spec) == local  # this node keeps loading the copy it verified
    monkeypatch.setenv("RAYSTACK_CACHE_DIR", str(tmp_path / "other-node"))  # a node that fetches now
    with pytest.raises(WeightsRefused, match=r"vLLM for m@v1 from s3://.*file config.json does not match"):
        verified_spec(spec)


def test_a_manifest_other_than_the_pinned_one_is_refused_before_any_file_is_read(
    tmp_path: Path, hashes: list[str]
) -> None:
    """A version rewritten in the store after its gate passed (here its manifest's eval score
    raised; the files still match it) is refused where it is pinned, and served where not."""
    from serving.config import EngineConfig
    from serving.replica.engine import EngineSpec, WeightsRefused, verified_spec

    store = CheckpointStore(str(tmp_path / "store"))
    store.publish(fake_checkpoint(tmp_path / "src"), fields("adder", "v1", score=0.5))
    manifest_file = Path(store.version_path("adder", "v1")) / "manifest.json"
    pin = hashlib.sha256(manifest_file.read_bytes()).hexdigest()
    cache = VerifiedCache(tmp_path / "cache")
    assert cache.resolve(store, "adder", "v1", pin).action == "verified"
    raw = json.loads(manifest_file.read_text())
    raw["eval"]["metrics"]["exact_match"] = 0.99
    manifest_file.write_text(json.dumps(raw))
    hashes.clear()
    with pytest.raises(
        TamperedVersion, match=rf"adder@v1: manifest.json has sha256 \w{{16}}\.\.\., not the {pin[:16]}"
    ):
        cache.resolve(store, "adder", "v1", pin)
    assert hashes == []  # refused on the manifest alone
    assert cache.resolve(store, "adder", "v1").action == "verified"  # unpinned: the files match it
    spec = EngineSpec(
        model="adder", version="v1", path=store.uri("adder", "v1"), manifest_sha256=pin, engine=EngineConfig()
    )
    with pytest.raises(WeightsRefused, match="refusing to start vLLM for adder@v1 .*manifest.json has sha256"):
        verified_spec(spec, str(tmp_path / "cache"))
    repinned = spec.model_copy(update={"manifest_sha256": hashlib.sha256(manifest_file.read_bytes()).hexdigest()})
    assert verified_spec(repinned, str(tmp_path / "cache")).path == store.version_path("adder", "v1")


def test_serving_up_reports_the_replicas_exception() -> None:
    from serving.control.stack import _failure

    app = {
        "status": "DEPLOY_FAILED",
        "message": "Failed to update the deployments ['m--v2'].",
        "deployments": {
            "m--v2": {
                "status": "DEPLOY_FAILED",
                "message": "The deployment failed to start 3 times in a row. Error:\n"
                + "Traceback line\n" * 400
                + "WeightsRefused: refusing to start vLLM for m@v2: m@v2: file model.safetensors does not match",
            }
        },
    }
    text = _failure(app)
    assert text.startswith("Failed to update the deployments") and text.endswith("model.safetensors does not match")
    assert len(text) < 1700


def test_a_local_file_rewritten_with_its_size_and_mtime_put_back_is_refused(tmp_path: Path) -> None:
    """A local store is verified in place; a writer that rewrites a verified file and restores its
    size and mtime (``os.utime``) still changes its change time, so the file is hashed again."""
    store = CheckpointStore(str(tmp_path / "store"))
    store.publish(fake_checkpoint(tmp_path / "src"), fields("adder", "v1"))
    cache = VerifiedCache(tmp_path / "cache")
    assert cache.resolve(store, "adder", "v1").action == "verified"
    assert cache.resolve(store, "adder", "v1").action == "cached"
    weights = Path(store.version_path("adder", "v1")) / "model.safetensors"
    st = weights.stat()
    weights.write_bytes(b"\xff" * st.st_size)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(TamperedVersion, match="file model.safetensors does not match its sha256"):
        cache.resolve(store, "adder", "v1")
