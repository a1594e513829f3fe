"""--base resolution: store versions (verified, manifest hash recorded), folders, URIs, init: and
the hub's clear offline error; which form wins when a string could be two of them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import fsspec
import pytest

from serving.node_cache import VerifiedCache
from serving.registry import CheckpointStore, TamperedVersion, VersionNotFound
from training.bases import BaseError, resolve_base

CORPUS = [{"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}] * 10


def _folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (path / "tokenizer.json").write_text("{}")
    return path


def _resolve(ref: str, tmp: Path, store: CheckpointStore | None = None):  # type: ignore[no-untyped-def]
    store = store or CheckpointStore(str(tmp / "store"))
    return resolve_base(ref, store, tmp / "work", tmp / "cache", lambda: CORPUS, "data-sha", seed=0)


def test_store_version_is_verified_and_its_manifest_hashed(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "store"))
    store.publish(_folder(tmp_path / "src"), {"model": "adder", "version": "v1"})
    base = _resolve("adder@v1", tmp_path, store)
    raw = (tmp_path / "store" / "adder" / "v1" / "manifest.json").read_bytes()
    assert base.ref.source == "store" and base.ref.ref == "adder@v1"
    assert base.ref.manifest_sha256 == hashlib.sha256(raw).hexdigest()
    assert base.directory == VerifiedCache().resolve(store, "adder", "v1").path and not base.is_init
    with pytest.raises(VersionNotFound):
        _resolve("adder@v9", tmp_path, store)
    (tmp_path / "store" / "adder" / "v1" / "tokenizer.json").write_text('{"changed": 1}')
    with pytest.raises(TamperedVersion):
        _resolve("adder@v1", tmp_path, store)


def test_a_lora_adapter_version_is_not_a_base(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "store"))
    base = store.publish(_folder(tmp_path / "src"), {"model": "adder", "version": "v1"})
    adapter = tmp_path / "lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    store.publish(
        adapter,
        {
            "model": "adder-max",
            "version": "v1",
            "base": {"source": "store", "ref": "adder@v1", "manifest_sha256": "0" * 64},
            "adapter": {"rank": 8, "alpha": 16, "target_modules": ["q_proj"]},
        },
    )
    assert base.adapter is None
    with pytest.raises(BaseError, match="adder-max@v1 is a LoRA adapter of adder@v1, not a model"):
        _resolve("adder-max@v1", tmp_path, store)


def test_existing_folder_wins_over_a_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _folder(tmp_path / "org" / "name")
    monkeypatch.chdir(tmp_path)
    base = _resolve("org/name", tmp_path)
    assert base.ref.source == "folder" and base.ref.ref == str(tmp_path / "org" / "name")
    (tmp_path / "empty").mkdir()
    with pytest.raises(BaseError, match="no config.json"):
        _resolve("empty", tmp_path)


def test_uri_is_downloaded(tmp_path: Path) -> None:
    fs = fsspec.filesystem("memory")
    fs.pipe("/bases/tiny/config.json", b'{"architectures": ["X"]}')
    fs.pipe("/bases/tiny/tokenizer.json", b"{}")
    base = _resolve("memory://bases/tiny", tmp_path)
    assert base.ref.source == "uri" and base.ref.ref == "memory://bases/tiny"
    assert (Path(base.directory) / "config.json").is_file() and (Path(base.directory) / "tokenizer.json").is_file()
    with pytest.raises(BaseError, match="no such folder"):
        _resolve("memory://bases/missing", tmp_path)


def test_uri_is_recorded_without_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fs = fsspec.filesystem("memory")
    fs.pipe("/signed/tiny/config.json", b'{"architectures": ["X"]}')
    store = CheckpointStore(str(tmp_path / "store"))
    paths = {"https://u:p@h/tiny?sig=s": "/signed/tiny", "https://u:p@h/gone?sig=s": "/signed/gone"}
    monkeypatch.setattr(fsspec.core, "url_to_fs", lambda ref: (fs, paths[ref]))
    base = _resolve("https://u:p@h/tiny?sig=s", tmp_path, store)
    assert base.ref.source == "uri" and base.ref.ref == "https://h/tiny?<redacted>"
    with pytest.raises(BaseError, match=r"^base https://h/gone\?<redacted>: cannot download: no such folder$"):
        _resolve("https://u:p@h/gone?sig=s", tmp_path, store)


def test_hub_id_offline_error_is_clear(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path)
    for ref in ("Qwen/Qwen2.5-0.5B", "hub:gpt2"):
        with pytest.raises(BaseError, match="Hugging Face hub failed .*HF_HUB_OFFLINE"):
            _resolve(ref, tmp_path)
    with pytest.raises(BaseError, match="not init:"):
        _resolve("a b c", tmp_path)


def test_init_base_is_built_once_per_ref_data_and_seed(tmp_path: Path) -> None:
    base = _resolve("init:qwen2-tiny", tmp_path)
    assert base.is_init and base.ref.source == "init" and base.ref.manifest_sha256 is None
    config = json.loads((Path(base.directory) / "config.json").read_text())
    assert config["model_type"] == "qwen2" and (Path(base.directory) / "tokenizer.json").is_file()
    assert _resolve("init:qwen2-tiny", tmp_path).directory == base.directory
    with pytest.raises(BaseError, match="init"):
        _resolve("init:gpt-huge", tmp_path)
