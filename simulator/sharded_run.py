"""Synthetic production-shaped training, on one process with rl_step or under torchrun
with sharded_rl_step (trainer.distributed), so the two can be compared step by step.

``python -m rtrl.simulator.sharded_run --steps N --out report.json`` (under
``torch.distributed.run`` for several ranks); tests/trainer/test_trainer_fsdp.py compares the runs.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import os
import random
import sys
from pathlib import Path

import torch

from rtrl import entrypoint
from rtrl.policy import EOS, encode
from rtrl.simulator.tasks import PROJECT_STYLES, random_style, random_task
from rtrl.trainer.batch import TrainBatch, TrainSample, collate
from rtrl.trainer.distributed import (
    World,
    broadcast_batch,
    close_world,
    full_state_dict,
    init_world,
    shard,
    sharded_rl_step,
)
from rtrl.trainer.sampling import prompt_ids
from rtrl.trainer.step import StepMetrics, build_optimizer, rl_step, token_logprobs

log = logging.getLogger("rtrl.simulator.sharded_run")


BATCH_ROWS = (8, 5, 1, 7, 4, 3)
"""Rows per step, cycled: uneven splits, and one batch smaller than two ranks."""
BEHAVIOUR_NOISE = 0.4
"""Std of the noise on the behaviour log-probs (nats): about 4% of tokens hit is_cap 2."""
KL_COEF, IS_CAP, LEARNING_RATE = 0.05, 2.0, 1e-3
GRAD_CLIP = 0.5
"""Below about half the steps' gradient norms, so clipping by the global norm matters."""


def synthetic_batches(model: torch.nn.Module, steps: int, seed: int) -> list[TrainBatch]:
    """Production-shaped batches: task prompts repeated 1-4 times (one comparison
    group each), completions in a random house style, sometimes cut off before EOS,
    rewarded when the style is the project's; behaviour log-probs are ``model``'s at
    the sampling temperature plus noise, as if sampled by a slightly different policy."""
    rng = random.Random(seed)
    noise = torch.Generator().manual_seed(seed)
    batches = []
    for step in range(steps):
        rows = BATCH_ROWS[step % len(BATCH_ROWS)]
        samples: list[TrainSample] = []
        while len(samples) < rows:
            task = random_task(rng)
            temperature = rng.choice((0.7, 1.0))
            for _ in range(min(rng.randint(1, 4), rows - len(samples))):
                style = random_style(rng)
                completion = encode(task.render(style)) + [EOS]
                completion = completion[: rng.randint(len(completion) // 2, len(completion))]
                house = (
                    PROJECT_STYLES[task.project]
                    if task.project < len(PROJECT_STYLES)
                    else random_style(rng)
                )
                samples.append(
                    TrainSample(
                        rollout_id=f"s{step}-r{len(samples)}",
                        group=task.prompt,
                        prompt_ids=tuple(prompt_ids(task.prompt)),
                        completion_ids=tuple(completion),
                        behaviour_logprobs=(0.0,) * len(completion),
                        temperature=temperature,
                        reward=float(style == house) + 0.1 * rng.random(),
                        oldest_version=0,
                        last_event_ts_ms=0,
                    )
                )
        batch = collate(samples)
        with torch.no_grad():
            logp, _ = token_logprobs(model, batch)
        jitter = BEHAVIOUR_NOISE * torch.randn(logp.shape, generator=noise)
        batches.append(
            dataclasses.replace(batch, behaviour_logprobs=(logp + jitter) * batch.target_mask)
        )
    return batches


def main() -> None:
    args = _arguments()
    entrypoint.configure_logging()

    from safetensors.torch import save_file

    from rtrl.policy import build_model, state_dict_fp32

    world = init_world()
    rank, world_size = (world.rank, world.world_size) if world else (0, 1)
    model = build_model(seed=args.seed)
    initial = state_dict_fp32(model)
    ref = copy.deepcopy(model)
    # Rank 0 makes the batches; the other ranks receive them.
    batches = synthetic_batches(model, args.steps, args.seed) if rank == 0 else []
    if world:
        batches = [
            broadcast_batch(batches[i] if rank == 0 else None, world) for i in range(args.steps)
        ]
        shard(model, world)
        shard(ref, world)
    history = _train(model, ref, batches, world, log_steps=rank == 0)
    final = full_state_dict(model, world) if world else state_dict_fp32(model)
    if rank == 0:
        assert final is not None  # full_state_dict gathers the weights on rank 0
        _write_report(args.out, world_size, history, initial, final)
        if args.weights:
            save_file(final, str(args.weights))
    if world:
        close_world()
        # Gloo's worker threads can still hold the last collectives' tensors, and
        # releasing them during interpreter shutdown aborts the process (SIGABRT in
        # about one run in ten), so leave without the shutdown.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument(
        "--out", type=Path, required=True, help="JSON of per-step metrics (written by rank 0)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--weights", type=Path, help="also save the final weights here (safetensors)"
    )
    return parser.parse_args()


def _train(
    model: torch.nn.Module,
    ref: torch.nn.Module,
    batches: list[TrainBatch],
    world: World | None,
    *,
    log_steps: bool,
) -> list[StepMetrics]:
    """One RL step per batch, sharded over ``world`` when there is one; the metrics of each."""
    optimizer = build_optimizer(model, LEARNING_RATE)
    history: list[StepMetrics] = []
    for step, batch in enumerate(batches):
        if world:
            metrics = sharded_rl_step(
                model,
                optimizer,
                batch,
                world,
                ref_model=ref,
                is_cap=IS_CAP,
                kl_coef=KL_COEF,
                grad_clip=GRAD_CLIP,
            )
        else:
            metrics = rl_step(
                model,
                optimizer,
                batch,
                ref_model=ref,
                is_cap=IS_CAP,
                kl_coef=KL_COEF,
                grad_clip=GRAD_CLIP,
            )
        history.append(metrics)
        if log_steps:
            log.info(
                "step %d rows %d tokens %d loss %.5f kl %.5f grad_norm %.4f clipped %.3f",
                step,
                metrics.rollouts,
                metrics.tokens,
                metrics.loss,
                metrics.kl,
                metrics.grad_norm,
                metrics.clipped_fraction,
            )
    return history


def _write_report(
    out: Path,
    world_size: int,
    history: list[StepMetrics],
    initial: dict[str, torch.Tensor],
    final: dict[str, torch.Tensor],
) -> None:
    moved = sum(((final[k] - initial[k]) ** 2).sum().item() for k in initial) ** 0.5
    report = {
        "world_size": world_size,
        "rows": [m.rollouts for m in history],
        "tokens": [m.tokens for m in history],
        "losses": [m.loss for m in history],
        "grad_norms": [m.grad_norm for m in history],
        "kl": [m.kl for m in history],
        "entropy": [m.entropy for m in history],
        "clipped_fraction": [m.clipped_fraction for m in history],
        "ratio_mean": [m.ratio_mean for m in history],
        "weight_keys": list(final),
        "weight_change_l2": moved,
        "final_checksum": sum(t.double().sum().item() for t in final.values()),
    }
    out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
