"""What ``router: kv_aware`` costs the gateway per request: the chat template and tokenizer, then
the block keys, for prompts of a few lengths, with each model's own tokenizer.

    python -m loadtests.kv_tokens [MODEL_DIR ...] [--runs 50]

Prints the median of ``--runs`` per prompt length (see docs/architecture.md, "KV-aware routing").
"""

from __future__ import annotations

import argparse
import random
import statistics
import string
import time

from serving.contract import block_keys
from serving.gateway.kv_index import Prompts
from serving.replica.kv_events import tokenizer_files

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", default=["checkpoints/adder/v1", "checkpoints/subtractor/v1"])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--chars", type=int, nargs="+", default=[400, 2000, 8000])
    ap.add_argument("--block-size", type=int, default=128)
    a = ap.parse_args(argv)
    print("| model | prompt tokens | template + tokenizer ms | block keys ms |")
    print("|---|---|---|---|")
    for model in a.models:
        prompts = Prompts.from_files(tokenizer_files(model))
        rng = random.Random(0)
        for chars in a.chars:
            system = "".join(rng.choice(string.ascii_lowercase + "  ") for _ in range(chars))
            body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "12+30="}]}
            tok_s, key_s, n = [], [], 0
            for _ in range(a.runs):
                t0 = time.perf_counter()
                tokens = prompts.tokens("chat", body) or []
                t1 = time.perf_counter()
                block_keys(tokens, a.block_size)
                tok_s.append(t1 - t0)
                key_s.append(time.perf_counter() - t1)
                n = len(tokens)
            print(f"| {model} | {n} | {statistics.median(tok_s) * 1e3:.2f} | {statistics.median(key_s) * 1e3:.3f} |")


if __name__ == "__main__":
    main()
