"""Randomly initialised Llama models for load tests and benchmarks (no model hub anywhere).

Throughput and latency do not depend on weight values, so a random model of a real
architecture's size is a fair load. The tokenizer is character-level (one token per character,
``<bos>`` prepended) so that a prompt of N characters is exactly N + 1 tokens on every server; the
vocabulary is padded with filler tokens up to the preset's size so that the embedding and LM head
have a real model's shape.

    python -m loadtests.models tiny --out /tmp/raystack-models/tiny-1k   # 2 layers x 128, 1024 positions
    python -m loadtests.models 1b --out /tmp/raystack-models/llama-1b     # ~0.95B parameters (GPU bench)

:func:`build_adapter` writes a random LoRA adapter of such a model (peft, every weight random, so
it changes the outputs) with the manifest of an adapter version trained on it.
"""

from __future__ import annotations

import argparse
import json
import string
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = ["PRESETS", "Preset", "build_adapter", "build_model", "build_tokenizer"]

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARS = string.ascii_letters + string.digits + string.punctuation + " "
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


@dataclass(frozen=True)
class Preset:
    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab: int
    max_positions: int
    dtype: str  # what the weights are saved as


PRESETS = {
    # head_dim 32: vLLM's CPU attention rejects head_dim 16.
    "tiny": Preset(hidden=128, layers=2, heads=4, intermediate=512, vocab=128, max_positions=1024, dtype="float32"),
    "small": Preset(hidden=512, layers=8, heads=8, intermediate=1536, vocab=4096, max_positions=2048, dtype="float32"),
    # ~0.95B parameters (TinyLlama-like width, 16 layers, full MHA): for the GPU benchmark.
    "1b": Preset(
        hidden=2048, layers=16, heads=32, intermediate=5632, vocab=32000, max_positions=4096, dtype="bfloat16"
    ),
}


def build_tokenizer(vocab_size: int, max_length: int) -> PreTrainedTokenizerFast:
    """Character-level WordLevel tokenizer padded with ``<f{i}>`` filler tokens to ``vocab_size``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tokens = list(SPECIALS) + list(CHARS)
    tokens += [f"<f{i}>" for i in range(max(0, vocab_size - len(tokens)))]
    vocab = {t: i for i, t in enumerate(tokens)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(list(SPECIALS))
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=max_length,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def build_model(out: str | Path, preset: str = "tiny", max_positions: int | None = None, seed: int = 0) -> Path:
    """Write a random Llama model plus tokenizer that vLLM loads; returns the directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    p = PRESETS[preset]
    positions = max_positions or p.max_positions
    out = Path(out)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        if not (out / "manifest.json").exists():  # built before replicas verified their weights
            write_manifest(out, f"init:random-{preset}")
        return out
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tok = build_tokenizer(p.vocab, positions)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=p.hidden,
        intermediate_size=p.intermediate,
        num_hidden_layers=p.layers,
        num_attention_heads=p.heads,
        num_key_value_heads=p.heads,
        max_position_embeddings=positions,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    dtype = getattr(torch, p.dtype)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(dtype)
    model.config.dtype = dtype
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    # transformers 5 writes tokenizer_class TokenizersBackend and keeps the template in a side
    # file; name the class every release knows and inline the template (older GPU images).
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg |= {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE}
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    params = sum(t.numel() for t in model.parameters())
    (out / "raystack-random-model.json").write_text(
        json.dumps({"preset": preset, "parameters": params, "seed": seed, "max_positions": positions}) + "\n"
    )
    write_manifest(out, f"init:random-{preset}")
    return out


ADAPTER_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
ADAPTER_RANK: Final = 8


def build_adapter(
    base_dir: str | Path, store_root: str | Path, name: str, base_ref: str, seed: int = 0, rank: int = ADAPTER_RANK
) -> Path:
    """A random rank-``rank`` LoRA adapter of the model in ``base_dir``, published to the store at
    ``store_root`` as ``name@v1`` (its manifest names ``base_ref``, ``model@version``: how the stack
    serving the base names it, and the base's manifest hash, as a LoRA training job publishes
    one); kept when already there. Returns the version's folder."""
    import tempfile

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from serving.manifest import MANIFEST, Adapter, BaseRef
    from serving.registry import CheckpointStore, architecture_of, sha256_file

    store = CheckpointStore(str(store_root))
    if store.exists(name, "v1"):
        return Path(store.version_path(name, "v1"))
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(ADAPTER_MODULES), init_lora_weights=False)
    fields = {
        "model": name,
        "version": "v1",
        "architecture": architecture_of(base_dir),
        "base": BaseRef(source="store", ref=base_ref, manifest_sha256=sha256_file(Path(base_dir) / MANIFEST)),
        "adapter": Adapter(rank=rank, alpha=2 * rank, target_modules=list(ADAPTER_MODULES)),
    }
    with tempfile.TemporaryDirectory() as tmp:
        get_peft_model(base, lora).save_pretrained(tmp)
        store.publish(tmp, fields)
    return Path(store.version_path(name, "v1"))


def write_manifest(out: Path, base: str) -> None:
    """A store version's ``manifest.json`` for the folder, named after its place
    ``<parent>/<name>`` (model, version): the stack's replicas load only directories whose files
    match a manifest (serving.node_cache), a benchmark model's too."""
    from datetime import UTC, datetime

    from serving.manifest import MANIFEST, BaseRef, Manifest
    from serving.registry import architecture_of, hash_tree

    files = hash_tree(out)
    manifest = Manifest(
        model=out.resolve().parent.name,
        version=out.name,
        architecture=architecture_of(out),
        base=BaseRef(source="init", ref=base),
        files=files,
        sizes={rel: (out / rel).stat().st_size for rel in files},
        created_at=datetime.now(UTC).replace(microsecond=0),
    )
    (out / MANIFEST).write_text(manifest.model_dump_json(indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("preset", choices=sorted(PRESETS))
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--max-positions", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    path = build_model(a.out, a.preset, a.max_positions, a.seed)
    print(path)


if __name__ == "__main__":
    main()
