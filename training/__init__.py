"""Training job: Ray Train (DDP) on generated arithmetic tasks, publishing versioned HF checkpoints.

Public entry point: :func:`training.train.train` (also ``python -m training.train``).
Heavy imports (torch, ray, transformers) are left to the submodules so that importing the package
stays cheap.
"""

from __future__ import annotations
