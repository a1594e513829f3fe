"""Training job: Ray Train (DDP) fine-tunes a Hugging Face base on JSONL data and publishes versioned,
hashed checkpoints (``training.train``); ``training.families`` and ``training.datasets`` build the
default local bases and their generated data.

Public entry point: :func:`training.train.train` (also ``python -m training.train``).
Heavy imports (torch, ray, transformers) are left to the submodules so that importing the package
stays cheap.
"""

from __future__ import annotations
