"""Score a published checkpoint with real vLLM: raw-prompt generate() and chat(), greedy.

Why: the training job's own score comes from the Hugging Face model in the worker; this proves the
*published* directory (weights, config, tokenizer, chat template) gives the same answers in the
engine that serves it. Run it as a script (vLLM spawns processes, hence the ``__main__`` guard)::

    VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 \\
        python -m training.vllm_eval --root ./checkpoints --model adder --version v1 --n 200

It verifies the version's hashes first and prints one JSON line with both exact-match figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from serving.registry import CheckpointStore
from training.data import exact_match, make_split

__all__ = ["evaluate_with_vllm", "main"]


def evaluate_with_vllm(directory: str, task: str, seed: int = 0, n: int = 200) -> dict[str, Any]:
    """Exact match of the model in ``directory`` on the first ``n`` held-out prompts of ``task``."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams

    examples = make_split(task, seed).eval[:n]
    t0 = time.monotonic()
    llm = LLM(model=directory, dtype="float32", max_model_len=64, seed=seed)
    load_s = time.monotonic() - t0
    params = SamplingParams(temperature=0.0, max_tokens=8)

    def generate(prompts: list[str]) -> list[str]:
        return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]

    def chat(prompts: list[str]) -> list[str]:
        conversations: list[Any] = [[{"role": "user", "content": p}] for p in prompts]
        return [o.outputs[0].text for o in llm.chat(conversations, params, use_tqdm=False)]

    t1 = time.monotonic()
    generate_em = exact_match(generate, examples)
    chat_em = exact_match(chat, examples)
    score_s = time.monotonic() - t1
    first = examples[0]
    sample = {"prompt": first.prompt, "expected": first.answer}
    sample |= {"generate": generate([first.prompt])[0], "chat": chat([first.prompt])[0]}
    return {
        "n": len(examples),
        "generate_exact_match": generate_em,
        "chat_exact_match": chat_em,
        "sample": sample,
        "load_s": round(load_s, 1),
        "score_s": round(score_s, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.vllm_eval", description=__doc__)
    p.add_argument("--root", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--version", required=True)
    p.add_argument("--n", type=int, default=200)
    args = p.parse_args(argv)
    store = CheckpointStore(args.root)
    manifest = store.verify(args.model, args.version)
    seed = int(getattr(manifest, "seed", 0) or 0)
    directory = store.local_path(args.model, args.version)
    result = evaluate_with_vllm(directory, manifest.task, seed, args.n)
    result["manifest_exact_match"] = manifest.eval.exact_match
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
