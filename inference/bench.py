"""``python -m inference.bench``: engine throughput on this machine (one thread).

Full micro-batches of task prompts, decoded to ``max_tokens`` unless EOS comes
first; prints completions/s and tokens/s. Not asserted anywhere: numbers depend on
the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from inference.engine import Engine, EngineConfig, prompt_token_ids
from rtrl.policy import build_model, state_dict_fp32
from simulator.tasks import random_task


def run(batch: int, max_tokens: int, batches: int, swap_policy: str) -> dict:
    torch.set_num_threads(1)
    engine = Engine(EngineConfig(max_batch=batch, swap_policy=swap_policy))
    engine.stage("control", 0, state_dict_fp32(build_model(seed=1)))
    engine.start()
    rng = random.Random(0)
    prompts = [prompt_token_ids(random_task(rng).prompt) for _ in range(batch * batches)]
    try:
        for f in [engine.submit("control", p, max_tokens=max_tokens) for p in prompts[:batch]]:
            f.result()  # warm-up
        started = time.perf_counter()
        futures = [engine.submit("control", p, max_tokens=max_tokens) for p in prompts]
        completions = [f.result() for f in futures]
        elapsed = time.perf_counter() - started
    finally:
        engine.stop()
    tokens = sum(len(c.result.token_ids) for c in completions)
    return {
        "batch": batch,
        "max_tokens": max_tokens,
        "completions": len(completions),
        "mean_tokens": tokens / len(completions),
        "completions_per_s": len(completions) / elapsed,
        "tokens_per_s": tokens / elapsed,
        "mean_latency_s": sum(c.latency_s for c in completions) / len(completions),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=30)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--swap-policy", default="keep")
    args = parser.parse_args()
    for key, value in run(args.batch, args.max_tokens, args.batches, args.swap_policy).items():
        print(f"{key:>18}  {value:.3f}" if isinstance(value, float) else f"{key:>18}  {value}")


if __name__ == "__main__":
    main()
