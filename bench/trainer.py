"""`rtrl bench trainer`: the training step against a bare torch loop on the same batch.

One batch of production-shaped rollouts: ``batch`` completions of ``max_tokens``
tokens sampled by the embedded engine from the simulator's task prompts, with their
behaviour log-probs, rewards in [0, 1] and groups of four per prompt. Then, alternating
in rounds so a drift in the machine's speed hits both sides:

* ``tokens_per_s``: trainer.step.rl_step (leave-one-out advantages, truncated
  importance ratios, k1 KL to a frozen reference, gradient clipping, AdamW, metrics);
* ``plain_loop_tokens_per_s``: the same forward passes (reference without gradients,
  policy with), log-softmax and gather, a masked policy-gradient loss, backward,
  gradient clipping and AdamW step, written as a bare loop;
* ``overhead_ratio`` = tokens_per_s / plain_loop_tokens_per_s (target >= 0.9).

Tokens are completion tokens, the ones the loss is over. Each side trains its own
copy of the same initial model, so neither runs on the other's updated weights.
"""

from __future__ import annotations

import copy
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress

from rtrl.bench import report
from rtrl.bench.report import code_version
from rtrl.inference.engine import Engine, EngineConfig, prompt_token_ids
from rtrl.policy import build_model, state_dict_fp32
from rtrl.simulator.tasks import random_task
from rtrl.trainer.batch import TrainBatch, TrainSample, collate
from rtrl.trainer.config import TrainerSettings
from rtrl.trainer.objective import leave_one_out_advantages
from rtrl.trainer.step import build_optimizer, rl_step


def production_batch(size: int, max_tokens: int, seed: int = 0) -> TrainBatch:
    """``size`` completions sampled by the engine (groups of four per prompt)."""
    rng = random.Random(seed)
    engine = Engine(EngineConfig(max_batch=min(size, 32)))
    engine.stage("control", 0, state_dict_fp32(build_model(seed=1)))
    engine.start()
    try:
        prompts = [random_task(rng).prompt for _ in range(size // 4)]
        requests = [(p, i) for i, p in enumerate(prompts) for _ in range(4)]
        futures = [
            engine.submit(
                "control",
                prompt_token_ids(p),
                max_tokens=max_tokens,
                ignore_eos=True,
                seed=rng.randrange(2**62),
            )
            for p, _ in requests
        ]
        samples: list[TrainSample] = []
        for (_prompt, group), future in zip(requests, futures, strict=True):
            done = future.result()
            samples.append(
                TrainSample(
                    rollout_id=f"r{len(samples)}",
                    group=f"g{group}",
                    prompt_ids=tuple(done.prompt_ids),
                    completion_ids=done.result.token_ids,
                    behaviour_logprobs=done.result.logprobs,
                    temperature=done.params.temperature,
                    reward=rng.random(),
                    oldest_version=0,
                    last_event_ts_ms=0,
                )
            )
    finally:
        engine.stop()
    return collate(samples)


def plain_step(
    model,
    ref,
    optimizer,
    batch: TrainBatch,
    advantages: torch.Tensor,
    kl_coef: float,
    grad_clip: float,
) -> None:
    """The bare loop's step: the same forward/backward as rl_step, nothing else."""
    ids, mask = batch.input_ids, batch.target_mask
    with torch.no_grad():
        ref_logp = (
            torch.log_softmax(
                ref(input_ids=ids).logits[:, :-1].float() / batch.temperature[:, None, None], -1
            )
            .gather(-1, ids[:, 1:, None])
            .squeeze(-1)
        )
    model.train()
    logp = (
        torch.log_softmax(
            model(input_ids=ids).logits[:, :-1].float() / batch.temperature[:, None, None], -1
        )
        .gather(-1, ids[:, 1:, None])
        .squeeze(-1)
    )
    ratio = torch.exp((logp.detach() - batch.behaviour_logprobs) * mask).clamp(max=2.0)
    token_adv = advantages[:, None] - kl_coef * (logp.detach() - ref_logp) * mask
    loss = -(ratio * token_adv * logp * mask).sum() / mask.sum()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    model.eval()


# Produced by run; written to bench/results/trainer.json; read by its test and docs/benchmarks.md.
@dataclass(frozen=True)
class TrainerResult:
    code: str
    """The commit of trainer/ the step ran at."""
    batch: int
    completion_tokens_per_step: int
    steps: int
    torch_threads: int
    tokens_per_s: float
    """Completion tokens per second through the trainer's rl_step."""
    plain_loop_tokens_per_s: float
    """The baseline: a bare torch loop with the same forward/backward on the same batch."""
    overhead_ratio: float
    """plain loop time over rl_step time: 1.0 means the trainer adds nothing."""


# Produced by run; read by timed_steps.
@dataclass(frozen=True)
class Sides:
    """The two sides on one batch, each with its own copy of the same initial model and its
    own optimizer, and the frozen reference both regularise towards."""

    batch: TrainBatch
    ref: torch.nn.Module
    models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]
    """By side ("trainer", "plain"): its model and its optimizer."""
    advantages: torch.Tensor
    """The bare loop's leave-one-out advantages, computed once outside its loop."""


def sides(batch: TrainBatch, settings: TrainerSettings) -> Sides:
    base = build_model(seed=1)
    ref = copy.deepcopy(base).eval()
    models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] = {}
    for side in ("trainer", "plain"):
        model = copy.deepcopy(base).eval()
        models[side] = (model, build_optimizer(model, settings.lr))
    advantages = torch.tensor(
        leave_one_out_advantages(batch.rewards, batch.groups, std_normalize=False),
        dtype=torch.float32,
    )
    return Sides(batch, ref, models, advantages)


def timed_steps(
    on: Sides, settings: TrainerSettings, steps: int, rounds: int, console: Console
) -> dict[str, float]:
    """Seconds each side took for ``rounds`` x ``steps`` steps, the sides alternating by round."""
    seconds = {"trainer": 0.0, "plain": 0.0}
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("trainer step vs bare loop", total=2 * rounds * steps)
        for _ in range(rounds):
            for side in ("trainer", "plain"):
                model, optimizer = on.models[side]
                started = time.perf_counter()
                for _ in range(steps):
                    if side == "trainer":
                        rl_step(
                            model,
                            optimizer,
                            on.batch,
                            ref_model=on.ref,
                            is_cap=settings.is_cap,
                            kl_coef=settings.kl_coef,
                            grad_clip=settings.grad_clip,
                        )
                    else:
                        plain_step(
                            model,
                            on.ref,
                            optimizer,
                            on.batch,
                            on.advantages,
                            settings.kl_coef,
                            settings.grad_clip,
                        )
                    progress.advance(task)
                seconds[side] += time.perf_counter() - started
    return seconds


def run(
    out: Path,
    console: Console,
    batch_size: int = 64,
    max_tokens: int = 48,
    steps: int = 10,
    rounds: int = 3,
) -> TrainerResult:
    settings = TrainerSettings()
    with console.status("sampling a batch with the engine"):
        batch = production_batch(batch_size, max_tokens)
    tokens_per_step = int(batch.target_mask.sum())
    seconds = timed_steps(sides(batch, settings), settings, steps, rounds, console)
    trained = tokens_per_step * steps * rounds
    result = TrainerResult(
        code=code_version("trainer"),
        batch=batch_size,
        completion_tokens_per_step=tokens_per_step,
        steps=steps * rounds,
        torch_threads=torch.get_num_threads(),
        tokens_per_s=round(trained / seconds["trainer"], 1),
        plain_loop_tokens_per_s=round(trained / seconds["plain"], 1),
        overhead_ratio=round(seconds["plain"] / seconds["trainer"], 3),
    )
    report.write(out, result)
    console.print(
        f"bench trainer -> {out}: rl_step {result.tokens_per_s:,.0f} tokens/s, "
        f"bare loop {result.plain_loop_tokens_per_s:,.0f}, overhead_ratio {result.overhead_ratio:.3f} "
        f"(target >= 0.9; batch {batch_size}, {tokens_per_step} completion tokens per step)"
    )
    return result
