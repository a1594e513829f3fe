"""``serving import``: a folder or an s3:// folder into a local or S3 store; refusals."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest

from serving.control.importer import ImportFailed, import_model, source_kind, source_ref
from serving.node_cache import VerifiedCache
from serving.registry import CheckpointStore, VersionExists
from tests.conftest import ROOT
from tests.unit.test_registry import fake_checkpoint


def hf_folder(directory: Path) -> Path:
    fake_checkpoint(directory)
    (directory / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (directory / ".git").mkdir()
    (directory / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    return directory


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "serving.control.cli", "import", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_folder_into_s3_store_then_served_from_the_cache(s3_bucket: str, tmp_path: Path) -> None:
    src = hf_folder(tmp_path / "llama")
    store = CheckpointStore(f"s3://{s3_bucket}/store")
    manifest = import_model(str(src), store, "llama-8b", "v1", log=lambda _: None)
    assert manifest.architecture == "LlamaForCausalLM" and manifest.eval is None
    assert manifest.base is not None and (manifest.base.source, manifest.base.ref) == ("folder", str(src))
    assert sorted(manifest.files) == ["config.json", "model.safetensors", "tokenizer/tokenizer.json"]  # no .git
    assert manifest.sizes["model.safetensors"] == 900
    assert store.list_versions("llama-8b") == ["v1"] and store.verify("llama-8b", "v1") == manifest
    assert VerifiedCache(tmp_path / "cache").resolve(store, "llama-8b", "v1").action == "downloaded"
    with pytest.raises(VersionExists, match="llama-8b@v1 already exists"):
        import_model(str(src), store, "llama-8b", "v1", log=lambda _: None)


def test_s3_source_into_local_store(s3_bucket: str, tmp_path: Path) -> None:
    import fsspec

    src = hf_folder(tmp_path / "llama")
    fs = fsspec.filesystem("s3")
    fs.put(str(src) + "/", f"{s3_bucket}/upstream/llama/", recursive=True)
    store = CheckpointStore(str(tmp_path / "store"))
    manifest = import_model(f"s3://{s3_bucket}/upstream/llama", store, "llama", "v2", log=lambda _: None)
    assert manifest.base is not None and manifest.base.source == "uri"
    assert sorted(manifest.files) == ["config.json", "model.safetensors", "tokenizer/tokenizer.json"]
    assert store.verify("llama", "v2") == manifest


def test_cli_import_and_refusals(s3_bucket: str, tmp_path: Path) -> None:
    src = hf_folder(tmp_path / "llama")
    root = f"s3://{s3_bucket}/cli"
    ok = cli(str(src), "--model", "llama-8b", "--version", "v1", "--root", root)
    assert ok.returncode == 0, ok.stderr
    assert "imported llama-8b@v1 (LlamaForCausalLM, 3 files" in ok.stdout and f"{root}/llama-8b/v1" in ok.stdout
    again = cli(str(src), "--model", "llama-8b", "--version", "v1", "--root", root)
    assert again.returncode == 2 and "already exists" in " ".join(again.stderr.split())
    (tmp_path / "nocfg").mkdir()
    bad = cli(str(tmp_path / "nocfg"), "--model", "x", "--version", "v1", "--root", str(tmp_path / "store"))
    assert bad.returncode == 2 and "not a Hugging Face model folder (no config.json)" in " ".join(bad.stderr.split())


def test_hub_without_network_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hub path cannot be exercised here (no hub): offline or unreachable, the error says what to do."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert source_kind("meta-llama/Llama-3.1-8B") == "hub"
    store = CheckpointStore(str(tmp_path / "store"))
    with pytest.raises(ImportFailed, match="cannot download meta-llama/Llama-3.1-8B.*import the folder"):
        import_model("meta-llama/Llama-3.1-8B", store, "llama-8b", "v1", log=lambda _: None)
    with pytest.raises(ImportFailed, match="no such folder"):
        source_kind(str(tmp_path / "missing"))


def _folder_with(tmp_path: Path, link: str, target: Path) -> Path:
    src = tmp_path / "llama"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (src / link).symlink_to(target)
    return src


def test_dangling_symlink_refused(tmp_path: Path) -> None:
    src = _folder_with(tmp_path, "model.safetensors", tmp_path / "gone" / "model.safetensors")
    store = CheckpointStore(str(tmp_path / "store"))
    with pytest.raises(ImportFailed, match=r"model.safetensors is a dangling symlink \(to .*gone/model.safetensors\)"):
        import_model(str(src), store, "llama", "v1", log=lambda _: None)
    assert not store.exists("llama", "v1")


def test_symlink_outside_the_folder_refused(tmp_path: Path) -> None:
    secret = tmp_path / "home" / "id_rsa"
    secret.parent.mkdir()
    secret.write_text("not weights")
    src = _folder_with(tmp_path, "model.safetensors", secret)
    store = CheckpointStore(str(tmp_path / "store"))
    with pytest.raises(ImportFailed, match=f"model.safetensors points outside the folder, to {re.escape(str(secret))}"):
        import_model(str(src), store, "llama", "v1", log=lambda _: None)
    (tmp_path / "shards").mkdir()
    (src / "model.safetensors").unlink()
    (src / "shards").symlink_to(tmp_path / "shards", target_is_directory=True)
    with pytest.raises(ImportFailed, match="shards is a symlinked folder"):
        import_model(str(src), store, "llama", "v1", log=lambda _: None)
    assert not store.exists("llama", "v1")


def test_a_local_dir_download_linking_into_a_hub_cache_imports(tmp_path: Path) -> None:
    """``snapshot_download(local_dir=...)`` folders may link into the hub cache's blobs."""
    blobs = tmp_path / "hf" / "models--org--llama" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / "abc").write_bytes(b"weights")
    src = _folder_with(tmp_path, "model.safetensors", blobs / "abc")
    store = CheckpointStore(str(tmp_path / "store"))
    manifest = import_model(str(src), store, "llama", "v1", log=lambda _: None)
    assert "model.safetensors" in manifest.files


def test_hf_cache_snapshot_imports_its_blobs(tmp_path: Path) -> None:
    """The hub cache's layout (what ``snapshot_download`` leaves): the snapshot's files link into
    the repo's ``blobs``; the store gets their bytes."""
    repo = tmp_path / "hub" / "models--org--llama"
    blobs = fake_checkpoint(tmp_path / "files")
    (blobs / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    (snapshot / "tokenizer").mkdir(parents=True)
    for i, rel in enumerate(["config.json", "model.safetensors", "tokenizer/tokenizer.json", ".gitattributes"]):
        (repo / "blobs" / f"blob{i}").write_bytes((blobs / rel).read_bytes() if (blobs / rel).exists() else b"*")
        (snapshot / rel).symlink_to(Path("../" * (rel.count("/") + 2)) / "blobs" / f"blob{i}")
    store = CheckpointStore(str(tmp_path / "store"))
    manifest = import_model(str(snapshot), store, "llama", "v1", log=lambda _: None)
    assert sorted(manifest.files) == ["config.json", "model.safetensors", "tokenizer/tokenizer.json"]
    assert manifest.architecture == "LlamaForCausalLM" and manifest.sizes["model.safetensors"] == 900
    published = Path(store.version_path("llama", "v1")) / "model.safetensors"
    assert not published.is_symlink() and published.read_bytes() == (blobs / "model.safetensors").read_bytes()
    assert store.verify("llama", "v1") == manifest


SECRET_URI = "memory://user:s3cr3t@bucket/llama?X-Amz-Signature=sig123"


def test_a_uri_with_credentials_is_logged_and_recorded_without_them(tmp_path: Path) -> None:
    """``user:password@`` and a query string (a presigned URL's signature) reach neither the log
    lines, nor ``base.ref`` in manifest.json, nor an error message."""
    import fsspec

    fs = fsspec.filesystem("memory")
    src = hf_folder(tmp_path / "llama")
    fs.put(str(src) + "/", "/user:s3cr3t@bucket/llama?X-Amz-Signature=sig123/", recursive=True)
    store = CheckpointStore(str(tmp_path / "store"))
    lines: list[str] = []
    try:
        manifest = import_model(SECRET_URI, store, "llama", "v1", log=lines.append)
        with pytest.raises(ImportFailed) as missing:
            import_model(SECRET_URI.replace("llama", "gone"), store, "llama", "v2", log=lines.append)
    finally:
        fs.rm("/user:s3cr3t@bucket", recursive=True)
    assert manifest.base is not None and manifest.base.ref == "memory://bucket/llama?<redacted>"
    recorded = (tmp_path / "store" / "llama" / "v1" / "manifest.json").read_text()
    assert lines == [f"downloading memory://bucket/{name}?<redacted> ..." for name in ("llama", "gone")]
    assert str(missing.value) == "memory://bucket/gone?<redacted>: no such folder"
    for text in (recorded, *lines, str(missing.value)):
        assert "s3cr3t" not in text and "sig123" not in text


@pytest.mark.parametrize(
    ("source", "kind", "ref"),
    [
        ("https://user:pw@host/m?sig=x", "uri", "https://host/m?<redacted>"),
        ("s3://bucket/models/llama", "uri", "s3://bucket/models/llama"),
        ("meta-llama/Llama-3.1-8B", "hub", "meta-llama/Llama-3.1-8B"),
    ],
)
def test_source_ref(source: str, kind: Literal["folder", "uri", "hub"], ref: str) -> None:
    assert source_ref(source, kind) == ref
