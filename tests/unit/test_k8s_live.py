"""``serving render-k8s`` applies the promotion record's live versions over the YAML's (as
``serving up`` does), so a re-apply of the rendered overlay does not undo a promotion; with no
record the files are the versions as written, as committed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from serving.config import load_config
from serving.control.cli import app
from serving.control.controller import with_live
from serving.control.k8s import (
    LIVE_HEADER,
    K8sError,
    as_written,
    committed_live,
    for_k8s,
    stale_k8s,
    store_live,
    write_k8s,
)
from serving.control.serve_config import build_serve_config
from serving.record import ControlStore

REPO = Path(__file__).resolve().parents[2]
PROMOTED = {"llama-8b": [("v1", 0), ("v2", 100)]}


def _repo(tmp_path: Path, root: Path) -> tuple[Path, Path]:
    """A scratch repo with gpu-prod whose checkpoint store is ``root``; (repo, its patch)."""
    data = yaml.safe_load((REPO / "deployments" / "gpu-prod.yaml").read_text())
    data["checkpoint_root"] = str(root)
    (tmp_path / "deployments").mkdir(parents=True)
    (tmp_path / "deployments" / "gpu-prod.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    overlay = tmp_path / "k8s" / "overlays" / "gpu-prod"
    overlay.mkdir(parents=True)
    (overlay / "kustomization.yaml").write_text("resources: []\n")
    return tmp_path, overlay / "serve-config.yaml"


def _serve_config(patch: Path) -> dict[str, object]:
    return dict(yaml.safe_load(yaml.safe_load(patch.read_text())["spec"]["serveConfigV2"]))


def test_no_record_renders_the_versions_as_written(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    repo, patch = _repo(tmp_path / "repo", tmp_path / "store")
    write_k8s(repo, live=store_live)
    text = patch.read_text()
    write_k8s(repo, live=as_written)
    assert patch.read_text() == text and LIVE_HEADER not in text
    seed = for_k8s(load_config(repo / "deployments" / "gpu-prod.yaml"))
    assert _serve_config(patch) == build_serve_config(seed, base=None, seed=seed)


def test_the_record_is_applied_named_and_checkable_without_the_store(tmp_path: Path) -> None:
    repo, patch = _repo(tmp_path / "repo", tmp_path / "store")
    store = ControlStore(str(tmp_path / "store"), "gpu-prod")
    store.set_live("llama-8b", PROMOTED["llama-8b"])
    store.set_live("gone", [("v9", 100)])  # a model this config no longer has: ignored
    write_k8s(repo, live=store_live)
    assert LIVE_HEADER + '{"llama-8b":[["v1",0],["v2",100]]}' in patch.read_text()
    seed = for_k8s(load_config(repo / "deployments" / "gpu-prod.yaml"))
    # exactly what the controller patches into the RayService for this record
    assert _serve_config(patch) == build_serve_config(with_live(seed, PROMOTED), base=None, seed=seed)
    assert committed_live(seed, patch) == PROMOTED
    assert stale_k8s(repo) == []  # a check without the store renders the record the file names
    assert stale_k8s(repo, live=store_live) == []
    assert stale_k8s(repo, live=as_written) == [patch]
    write_k8s(repo, live=as_written)
    assert LIVE_HEADER not in patch.read_text() and _serve_config(patch) == build_serve_config(seed, seed=seed)


def test_an_unreachable_store_keeps_the_committed_record_and_a_broken_one_is_an_error(tmp_path: Path) -> None:
    repo, patch = _repo(tmp_path / "repo", tmp_path / "store")
    ControlStore(str(tmp_path / "store"), "gpu-prod").set_live("llama-8b", PROMOTED["llama-8b"])
    write_k8s(repo, live=store_live)
    promoted = patch.read_text()
    shutil.move(tmp_path / "store", tmp_path / "elsewhere")  # as /mnt/checkpoints on a laptop
    assert write_k8s(repo, live=store_live) == [patch, patch.with_name("image.yaml")]
    assert patch.read_text() == promoted  # the promotion is not dropped
    live_json = tmp_path / "store" / ".control" / "gpu-prod" / "live.json"
    live_json.parent.mkdir(parents=True)
    live_json.write_text("{half a file")
    with pytest.raises(K8sError, match="--as-written"):
        write_k8s(repo, live=store_live)


def test_the_command_reads_the_record_unless_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo, patch = _repo(tmp_path / "repo", tmp_path / "store")
    ControlStore(str(tmp_path / "store"), "gpu-prod").set_live("llama-8b", PROMOTED["llama-8b"])
    monkeypatch.chdir(repo)
    runner = CliRunner()
    assert runner.invoke(app, ["render-k8s", "--env", "gpu-prod"]).exit_code == 0
    assert LIVE_HEADER in patch.read_text()
    assert runner.invoke(app, ["render-k8s", "--check"]).exit_code == 0
    assert runner.invoke(app, ["render-k8s", "--check", "--as-written"]).exit_code == 1
    assert runner.invoke(app, ["render-k8s", "--as-written"]).exit_code == 0
    assert LIVE_HEADER not in patch.read_text()
