"""The base version an adapter version is deployed on, as a deploy builds it (manifests read): a
manifest that cannot be read fails the build instead of a guess, and the base version must serve
the very checkpoint the adapter was trained on (its manifest's sha256, as the adapter records it)."""

from __future__ import annotations

import errno
import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from fsspec.implementations.local import LocalFileSystem

from serving.config import ConfigError, parse_config
from serving.control.serve_config import ManifestUnreadable, adapter_bases, build_serve_config
from serving.manifest import manifest_sha256
from tests.unit.test_adapters import _publish_adapter, _stack
from tests.unit.test_controller import Clock, Cluster, _controller, _publish


@contextmanager
def store_down(looks_empty: bool = False) -> Iterator[None]:
    """Every read of a ``manifest.json`` fails as on a store out of reach; ``looks_empty``: the
    folders' listing says nothing is there too (``os.path.isdir`` swallows an I/O error)."""
    cat_file, isdir = LocalFileSystem.cat_file, LocalFileSystem.isdir

    def failing_cat(self: LocalFileSystem, path: str, *a: Any, **k: Any) -> Any:
        if str(path).endswith("manifest.json"):
            raise OSError(errno.EIO, "store unreachable", str(path))
        return cat_file(self, path, *a, **k)

    def blind_isdir(self: LocalFileSystem, path: str) -> bool:
        return False if looks_empty and "/ck/" in str(path) else bool(isdir(self, path))

    with (
        mock.patch.object(LocalFileSystem, "cat_file", failing_cat),
        mock.patch.object(LocalFileSystem, "isdir", blind_isdir),
    ):
        yield


def _sha(root: Path, model: str, version: str) -> str:
    return manifest_sha256((root / model / version / "manifest.json").read_bytes())


def test_an_adapter_manifest_that_cannot_be_read_fails_the_build(tmp_path: Path) -> None:
    """Not published (a version still to be trained): the base's live version, as before. There
    but unreadable: ManifestUnreadable (an OSError), never the base's live version."""
    root = tmp_path / "ck"
    _publish(root, "calc", "v1")
    _publish(root, "calc", "v2")
    _publish_adapter(root, "sub", "v1", "calc@v1", base_sha=_sha(root, "calc", "v1"))
    stack = _stack(root, [{"name": "sub", "base": "calc", "versions": [{"version": "v1", "weight": 100},
                                                                        {"version": "v2", "weight": 0}]}])  # fmt: skip
    stack["models"][0]["versions"] = [{"version": "v2", "weight": 100}, {"version": "v1", "weight": 0}]
    cfg = parse_config(stack)
    assert adapter_bases(cfg, read_manifests=True) == {("sub", "v1"): "v1", ("sub", "v2"): "v2"}  # v2: to be trained
    with store_down(), pytest.raises(ManifestUnreadable, match=r"sub/v1.*store unreachable"):
        adapter_bases(cfg, read_manifests=True)
    with store_down(), pytest.raises(OSError):
        build_serve_config(cfg, read_manifests=True)
    # a read that found nothing although a valid manifest is there is no "not published" either
    with mock.patch("serving.control.serve_config.manifest_at", lambda path: None):
        with pytest.raises(ManifestUnreadable, match="is there, but a read of it failed"):
            adapter_bases(cfg, read_manifests=True)
    assert adapter_bases(cfg) == {("sub", "v1"): "v2", ("sub", "v2"): "v2"}  # offline: no manifest read


def test_an_adapter_is_served_only_on_the_base_manifest_it_was_trained_on(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _publish(root, "calc", "v1")
    _publish(root, "calc", "v2")
    sha_v1, sha_v2 = _sha(root, "calc", "v1"), _sha(root, "calc", "v2")
    _publish_adapter(root, "sub", "v1", "calc@v1", base_sha=sha_v1)
    stack = _stack(root)
    assert adapter_bases(parse_config(stack), read_manifests=True) == {("sub", "v1"): "v1"}

    # calc's v1 entry is calc@v2's checkpoint: another folder under the same version name
    stack["models"][0]["versions"] = [{"version": "v1", "path": str(root / "calc" / "v2")}]
    with pytest.raises(ConfigError) as exc:
        build_serve_config(parse_config(stack), read_manifests=True)
    for part in ("models[sub].versions[v1]: trained on calc@v1", "models[calc].versions[v1] serves calc@v2",
                 sha_v1, sha_v2):  # fmt: skip
        assert part in str(exc.value), str(exc.value)

    # the served calc@v1 is not the one recorded (re-published with other weights, say)
    _publish_adapter(root, "sub", "v2", "calc@v1", base_sha="0" * 64)
    stack = _stack(root, [{"name": "sub", "base": "calc", "versions": [{"version": "v2"}]}])
    with pytest.raises(ConfigError, match=rf"versions\[v2\]: trained on calc@v1 \(manifest sha256 0{{64}}\), but "
                       rf"models\[calc\]\.versions\[v1\] serves calc@v1 \(manifest sha256 {sha_v1}\)"):  # fmt: skip
        build_serve_config(parse_config(stack), read_manifests=True)

    # a base version with no manifest to compare
    (tmp_path / "bare").mkdir()
    stack = _stack(root, versions=[{"version": "v1", "path": str(tmp_path / "bare")}])
    with pytest.raises(ConfigError, match=r"models\[calc\]\.versions\[v1\] has no manifest at .*bare to compare"):
        build_serve_config(parse_config(stack), read_manifests=True)


def test_a_base_served_from_a_path_is_matched_by_its_manifest_hash(tmp_path: Path) -> None:
    """As tests/integration/stack.yaml's adder-kv: the same checkpoint (the very manifest bytes)
    served from a ``path:``, under the adapter's base name or another; a copy whose manifest says
    the same model@version in other bytes is not it."""
    root = tmp_path / "ck"
    _publish(root, "calc", "v1")
    sha = _sha(root, "calc", "v1")
    _publish_adapter(root, "sub", "v1", "calc@v1", base_sha=sha)
    shutil.copytree(root / "calc" / "v1", tmp_path / "same")
    stack = _stack(root, [{"name": "sub", "base": "calc-kv", "versions": [{"version": "v1"}]}])
    kv = {"name": "calc-kv", "versions": [{"version": "v9", "path": str(tmp_path / "same")}]}
    stack["models"].append(kv)
    cfg = parse_config(stack)
    assert adapter_bases(cfg, read_manifests=True) == {("sub", "v1"): "v9"}
    assert _controller(tmp_path, stack, Clock(), Cluster(Clock())).bases.version_for(cfg.model("sub"), "v1") == "v9"
    # the same name, from a path: the hashes decide
    same_name = _stack(root, versions=[{"version": "v1", "path": str(tmp_path / "same")}])
    assert adapter_bases(parse_config(same_name), read_manifests=True) == {("sub", "v1"): "v1"}

    other = tmp_path / "other"
    shutil.copytree(root / "calc" / "v1", other)
    manifest = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps(manifest | {"created_at": "2026-12-01T00:00:00Z"}))
    kv["versions"] = [{"version": "v9", "path": str(other)}]
    with pytest.raises(ConfigError, match=rf"not a LoRA adapter of 'calc-kv' \(.*calc@v1, manifest sha256 {sha}\)"):
        build_serve_config(parse_config(stack), read_manifests=True)
    same_name["models"][0]["versions"] = [{"version": "v1", "path": str(other)}]
    with pytest.raises(ConfigError, match=rf"trained on calc@v1 \(manifest sha256 {sha}\), but models\[calc\]"):
        build_serve_config(parse_config(same_name), read_manifests=True)
