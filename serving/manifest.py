"""What a version's ``manifest.json`` says (:class:`Manifest`): every other file of the version
with its sha256 and size, and where the version came from: its base, its training run and data,
its evaluation, its adapter shape. The checkpoint store (:mod:`serving.registry`) writes it last
when it publishes a version and checks every file against it before a version is served.
"""

from __future__ import annotations

import hashlib
from datetime import datetime
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, field_validator

__all__ = [
    "MANIFEST",
    "Adapter",
    "BaseRef",
    "DataRef",
    "Evaluation",
    "Manifest",
    "TrainingRun",
    "check_file_name",
    "manifest_sha256",
]

MANIFEST: Final = "manifest.json"


class DataRef(BaseModel):
    """A dataset a version was trained or evaluated on: where it was read and what it held."""

    model_config = ConfigDict(extra="forbid")

    uri: str
    sha256: str
    rows: int
    format: Literal["chat", "completion", "mixed"]


class BaseRef(BaseModel):
    """Where a version's weights started.

    ``source`` says how ``ref`` is read: ``store`` (``model@version`` of this store, whose
    manifest hash is recorded), ``folder`` (a local Hugging Face folder), ``uri`` (an fsspec URI of
    one), ``hub`` (a Hugging Face hub id) or ``init`` (freshly initialised by the project's own
    builder, e.g. ``init:llama-tiny``).
    """

    model_config = ConfigDict(extra="forbid")

    source: Literal["store", "folder", "uri", "hub", "init"]
    ref: str
    manifest_sha256: str | None = None


class Evaluation(BaseModel):
    """Scores on an evaluation set. ``metrics`` holds every figure computed (``exact_match``,
    ``mean_token_loss``, ``perplexity``...); a promotion gate names the one it compares."""

    model_config = ConfigDict(extra="forbid")

    metrics: dict[str, float]
    n: int
    data: DataRef | None = None

    def value(self, metric: str) -> float | None:
        return self.metrics.get(metric)


class TrainingRun(BaseModel):
    """How the training job produced a version."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["full", "lora"]
    steps: int
    final_loss: float
    seed: int = 0
    workers: int = 1
    resumed_from_step: int = 0
    wall_s: float = 0.0
    data: DataRef
    hyperparameters: dict[str, Any] = {}


class Adapter(BaseModel):
    """A LoRA adapter version: its shape, which the base deployment's engine must admit
    (``--max-lora-rank``), and the modules it adapts. The base it applies to is the manifest's
    ``base`` (always ``source: store``, with that version's manifest hash)."""

    model_config = ConfigDict(extra="forbid")

    rank: int
    alpha: int
    target_modules: list[str]


class Manifest(BaseModel):
    """``manifest.json`` of one version. Extra fields are kept, so writers may add provenance.

    ``files`` maps every other file of the version to its sha256 and ``sizes`` to its size in
    bytes (the cheap check a node-local cache repeats at each start); their keys are paths inside
    the version directory (:func:`check_file_name`). A trained version records its ``base``,
    ``training`` and ``eval``; an imported one (``serving import``) its ``base`` only.
    """

    model_config = ConfigDict(extra="allow")

    model: str
    version: str
    architecture: str | None = None
    base: BaseRef | None = None
    training: TrainingRun | None = None
    eval: Evaluation | None = None
    adapter: Adapter | None = None
    files: dict[str, str]
    sizes: dict[str, int] = {}
    created_at: datetime
    code_revision: str = "unknown"

    @field_validator("files", "sizes")
    @classmethod
    def _file_names(cls, value: dict[str, Any]) -> dict[str, Any]:
        for name in value:
            check_file_name(name)
        return value


def check_file_name(name: str) -> str:
    """A version's file names become paths under its directory, on the store and in a node's
    cache: relative POSIX paths without an empty, ``.`` or ``..`` segment, without a backslash, and
    not the manifest. Object stores accept keys such as ``v1/../../x``; such a name is refused."""
    segments = name.split("/")
    if name == MANIFEST or "\\" in name or any(seg in ("", ".", "..") for seg in segments):
        raise ValueError(
            f"invalid file name {name!r}: a file of a version is a relative POSIX path inside it "
            f"(no '..', '.' or empty segment, no leading '/', no backslash, not {MANIFEST})"
        )
    return name


def manifest_sha256(raw: bytes) -> str:
    """A manifest's identity: the sha256 of its exact bytes (a version's pin, a node cache's key)."""
    return hashlib.sha256(raw).hexdigest()
