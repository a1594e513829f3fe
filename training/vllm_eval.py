"""Score a published version with real vLLM on evaluation JSONL, greedy, two ways.

Why: the training job's own score comes from the Hugging Face model in the worker; this proves
the *published* folder (weights, config, tokenizer, chat template) gives the same answers in the
engine that serves it. ``generate`` feeds vLLM the very prompt token ids the job evaluated on, so
its exact match should equal the manifest's; ``chat`` lets vLLM render chat rows with the folder's
template itself (tools included), as the OpenAI server does. Run it as a script (vLLM spawns
processes, hence the ``__main__`` guard)::

    VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 \\
        python -m training.vllm_eval --root ./checkpoints --model adder --version v1 [--eval FILE]

It verifies the version's hashes first and prints one JSON line. ``--eval`` defaults to the
manifest's eval file (a holdout of the training file must be given explicitly). A LoRA adapter
version is scored on its base version (verified too) with ``--enable-lora``, the adapter applied
to every request, as a base replica serves it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from serving.node_cache import VerifiedCache
from serving.registry import CheckpointStore
from training.encode import Encoder, normalise, stop_ids
from training.jsonl import load_jsonl

__all__ = ["evaluate_with_vllm", "main"]


def evaluate_with_vllm(
    directory: str, eval_uri: str, n: int = 200, max_model_len: int = 512, adapter: tuple[str, int] | None = None
) -> dict[str, Any]:
    """Exact match of the model in ``directory`` on the first ``n`` rows of ``eval_uri``; with
    ``adapter`` (its folder and rank), of that LoRA adapter applied to the model."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    rows = load_jsonl(eval_uri).rows[:n]
    tokenizer = AutoTokenizer.from_pretrained(directory)
    stop = stop_ids(directory, tokenizer)
    encoder = Encoder(tokenizer, max_model_len, stop)
    items = [encoder.eval_item(r) for r in rows]
    t0 = time.monotonic()
    lora_args: dict[str, Any] = {}
    lora: dict[str, Any] = {}
    if adapter is not None:
        from vllm.lora.request import LoRARequest

        lora_args = {"enable_lora": True, "max_lora_rank": adapter[1], "max_loras": 1}
        lora = {"lora_request": LoRARequest("adapter", 1, adapter[0])}
    llm = LLM(model=directory, dtype="float32", max_model_len=max_model_len, seed=0, **lora_args)
    load_s = time.monotonic() - t0
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=it.reference_tokens + 4, stop_token_ids=stop, skip_special_tokens=False
        )
        for it in items
    ]
    prompts = [TokensPrompt(prompt_token_ids=it.prompt_ids) for it in items]
    outputs = llm.generate(prompts, params, use_tqdm=False, **lora)
    generated = [normalise(o.outputs[0].text) == it.reference for o, it in zip(outputs, items, strict=True)]
    chat_idx = [i for i, r in enumerate(rows) if r.format == "chat"]
    chats: list[Any] = [_prompt_messages(rows[i].messages or []) for i in chat_idx]
    tools = [rows[i].tools for i in chat_idx]
    chat_hits = []
    for conversation, tool, i in zip(chats, tools, chat_idx, strict=True):  # one call per tool set
        out = llm.chat([conversation], params[i], use_tqdm=False, tools=tool, **lora)
        chat_hits.append(normalise(out[0].outputs[0].text) == items[i].reference)
    return {
        "n": len(items),
        "generate_exact_match": sum(generated) / max(1, len(items)),
        "chat_n": len(chat_hits),
        "chat_exact_match": sum(chat_hits) / max(1, len(chat_hits)),
        "load_s": round(load_s, 1),
        "score_s": round(time.monotonic() - t0 - load_s, 1),
    }


def _prompt_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[:last]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.vllm_eval", description=__doc__)
    p.add_argument("--root", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--version", required=True)
    p.add_argument("--eval", default=None, help="eval JSONL (default: the manifest's eval file)")
    p.add_argument("--n", type=int, default=200)
    args = p.parse_args(argv)
    store = CheckpointStore(args.root)
    manifest = store.verify(args.model, args.version)
    uri = args.eval or (manifest.eval.data.uri if manifest.eval and manifest.eval.data else None)
    if uri is None or "#" in uri:
        p.error(f"{args.model}@{args.version} was evaluated on {uri!r}; pass --eval FILE")
    cache = VerifiedCache()
    directory, adapter = cache.resolve(store, args.model, args.version).path, None
    if manifest.adapter is not None and manifest.base is not None:
        base_model, base_version = manifest.base.ref.split("@", 1)
        store.verify(base_model, base_version)
        directory, adapter = cache.resolve(store, base_model, base_version).path, (directory, manifest.adapter.rank)
    result = evaluate_with_vllm(directory, uri, args.n, adapter=adapter)
    result["manifest_exact_match"] = manifest.eval.value("exact_match") if manifest.eval else None
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
