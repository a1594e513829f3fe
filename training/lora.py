"""LoRA adapters (peft): the options a job takes, and how a worker wraps, checkpoints and saves one.

An adapter is trained on a base from the checkpoint store and published as its own version: the
folder vLLM loads with ``--enable-lora`` (``adapter_config.json`` + ``adapter_model.safetensors``),
with the base's ``model@version`` in ``adapter_config.json`` and in the manifest. Only the adapter's
weights are trainable, checkpointed and published; the base's are read from the base folder on
every (re)start, so a resumed run and the published adapter are small whatever the base.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["LoraOptions", "adapter_state", "check_targets", "load_adapter_state", "save_adapter", "wrap"]

# The projections of the Llama/Qwen2/Mistral decoder layers, which vLLM's LoRA kernels serve.
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
logger = logging.getLogger("training")


@dataclass(frozen=True)
class LoraOptions:
    """``--lora-rank``, ``--lora-alpha`` and ``--lora-targets`` of the training job."""

    rank: int = 8
    alpha: int = 16
    target_modules: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self) -> None:
        if self.rank < 1 or self.alpha <= 0 or not self.target_modules:
            raise ValueError("LoRA needs rank >= 1, alpha > 0 and at least one target module")

    @classmethod
    def from_args(cls, rank: int, alpha: int, targets: str) -> LoraOptions:
        return cls(rank, alpha, tuple(t.strip() for t in targets.split(",") if t.strip()))

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["target_modules"] = list(self.target_modules)
        return d


def wrap(model: Any, options: dict[str, Any]) -> Any:
    """The base model with fresh adapters on ``target_modules``; only their weights train."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=int(options["rank"]),
        lora_alpha=int(options["alpha"]),
        target_modules=list(options["target_modules"]),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def check_targets(base_dir: str, options: LoraOptions) -> None:
    """Refuse target names peft would refuse in every worker, or silently skip: one that matches
    no module of the base (peft matches a module whose name is the target or ends in ``.<target>``),
    or a module peft cannot adapt (not a linear, embedding or convolution layer).

    The base's modules come from its ``config.json``, built on the meta device: no weights are read.
    A config transformers cannot build here is left to the workers, whose own load would fail.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base_dir))
    except Exception as exc:  # custom code, an unknown model_type...: not this check's to report
        logger.warning("cannot list the modules of %s to check --lora-targets: %s", base_dir, exc)
        return
    nn = torch.nn
    kinds = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention, Conv1D)
    modules = dict(model.named_modules())
    problems = []
    for target in options.target_modules:
        matched = [name for name in modules if name == target or name.endswith(f".{target}")]
        bad = [name for name in matched if not isinstance(modules[name], kinds)]
        if not matched:
            problems.append(f"{target!r} matches no module")
        elif bad:
            problems.append(f"{target!r} matches {bad[0]} ({type(modules[bad[0]]).__name__}), which LoRA cannot adapt")
    if problems:
        names = sorted({name.rsplit(".", 1)[-1] for name, m in modules.items() if isinstance(m, kinds)})
        raise ValueError(
            f"--lora-targets for the base's {type(model).__name__}: {'; '.join(problems)}. "
            f"Its adaptable modules are named {', '.join(names)}"
        )


def adapter_state(model: Any) -> dict[str, Any]:
    """The adapter's weights only (what a checkpoint keeps)."""
    from peft import get_peft_model_state_dict

    return dict(get_peft_model_state_dict(model))


def load_adapter_state(model: Any, state: dict[str, Any]) -> None:
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(model, state)


def save_adapter(model: Any, out: Path, base_ref: str) -> None:
    """Write the folder vLLM loads; ``base_model_name_or_path`` names the store version it needs.
    peft's generated model card (``README.md``) is left out: the manifest says what it would."""
    model.save_pretrained(out)
    (out / "README.md").unlink(missing_ok=True)
    cfg_file = out / "adapter_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["base_model_name_or_path"] = base_ref
    cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
