"""Stock Ray Serve LLM (``ray.serve.llm.build_openai_app``) on a private local Ray, for the benchmark.

Run as its own process by :mod:`loadtests.servers`: it starts a *new* local Ray instance
(``address="local"``, its own temp dir, no dashboard), so it never joins or stops anyone else's
cluster; SIGTERM shuts Serve and that Ray instance down. Engine arguments come as JSON from the
benchmark, identical to what the bare vLLM server and our stack get.

    python -m loadtests.rayllm_app --model-dir DIR --port 8032 --engine '{"dtype": "float32", ...}'
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--model-id", default="bench")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--engine", required=True, help="engine_kwargs as JSON")
    ap.add_argument("--num-cpus", type=int, default=8, help="logical CPUs (ingress needs its own)")
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--temp-dir", default=f"/tmp/rb-{os.getpid()}")
    a = ap.parse_args(argv)

    import ray
    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app

    env_vars = {
        k: os.environ[k]
        for k in ("VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
        if k in os.environ
    }
    ray.init(
        address="local",
        num_cpus=a.num_cpus,
        include_dashboard=False,
        _temp_dir=a.temp_dir,
        runtime_env={"env_vars": env_vars},
        log_to_driver=False,
    )
    stop = threading.Event()  # handlers after ray.init, which installs its own
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        bundle = {"CPU": 1, "GPU": 1} if a.gpu else {"CPU": 1}
        config = LLMConfig(
            model_loading_config={"model_id": a.model_id, "model_source": a.model_dir},
            placement_group_config={"bundles": [bundle]},
            engine_kwargs=json.loads(a.engine),
            runtime_env={"env_vars": env_vars},
        )
        serve.start(http_options={"host": "127.0.0.1", "port": a.port})
        serve.run(build_openai_app({"llm_configs": [config]}), blocking=False)
        print(f"stock Ray Serve LLM ready on 127.0.0.1:{a.port}", flush=True)
        stop.wait()
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
