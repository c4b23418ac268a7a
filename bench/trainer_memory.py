"""`rtrl bench trainer-memory`: the trainer's peak memory on long agent trajectories.

Each case runs in a fresh interpreter: a tiny Qwen3 (rtrl/ops/tiny_model.py, 40k
positions) and a batch of agent trajectories as the trainer reads them (a reward record
through trainer.batch.to_sample and collate; bench/agent_load.trajectory: a
512-token prompt, then turns of a 48-token tool call and a 208-token result), then one
rl_step. ``peak_mb`` is the process's peak resident memory during the step above what it
held before it (model, optimizer, batch); ``step_s`` the step's time.

The cases: one trajectory of 4k tokens and one of 32k (a row longer than any budget is a
micro-batch of its own: its memory is the floor), and eight of 4k in one batch, whole (one
forward over all eight, as the default RTRL_TRAINER_MICRO_BATCH_TOKENS of 32k positions
takes them) and in micro-batches of 16k (four rows each) or 4k (one row each): the ratio is
what the budget saves.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM

from rtrl.bench import report
from rtrl.bench.agent_load import trajectory
from rtrl.bench.report import code_version
from rtrl.ops.tiny_model import tiny_config
from rtrl.trainer.batch import TrainSample, collate, to_sample
from rtrl.trainer.step import build_optimizer, rl_step
from rtrl.v1 import common_pb2, reward_pb2, rollout_pb2

VOCAB = 518
CASES = (
    ("1 x 4k", 4096, 1, None),
    ("1 x 32k", 32768, 1, None),
    ("8 x 4k, whole", 4096, 8, None),
    ("8 x 4k, micro-batches of 16k", 4096, 8, 16384),
    ("8 x 4k, micro-batches of 4k", 4096, 8, 4096),
)


def _reward(tokens: int, index: int) -> reward_pb2.RewardRecord:
    record = rollout_pb2.RolloutRecord(
        rollout_id=f"r{index}",
        arm=common_pb2.ARM_TREATMENT,
        sampling=rollout_pb2.SamplingParams(temperature=1.0),
    )
    trajectory(tokens).write(record)
    for ids in (record.prompt_token_ids, *(s.token_ids for s in record.segments)):
        ids[:] = [(t + index) % VOCAB for t in ids]
    return reward_pb2.RewardRecord(rollout_id=record.rollout_id, rollout=record, reward=index % 2)


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_case(tokens: int, rows: int, budget: int | None) -> dict[str, float]:
    """In this process: the step's peak resident memory above what was held before it."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3", VOCAB, 40960))
    samples = [to_sample(_reward(tokens, i), 40960, vocab_size=VOCAB) for i in range(rows)]
    assert all(isinstance(s, TrainSample) for s in samples), samples
    batch = collate([s for s in samples if isinstance(s, TrainSample)])
    optimizer = build_optimizer(model, 1e-4)
    held = _peak_bytes()
    start = time.perf_counter()
    rl_step(model, optimizer, batch, token_budget=budget)
    elapsed = time.perf_counter() - start
    return {"peak_mb": (_peak_bytes() - held) / 2**20, "step_s": elapsed}


# Produced by run; written to bench/results/trainer_memory.json.
@dataclass(frozen=True)
class MemoryCase:
    case: str
    tokens: int
    rows: int
    micro_batch_tokens: int
    """0: the whole batch in one forward."""
    peak_mb: float
    step_s: float


@dataclass(frozen=True)
class TrainerMemoryResult:
    code: str
    cases: tuple[MemoryCase, ...]
    whole_vs_micro_4k: float
    """Peak of the eight 4k rows in one forward over the same in micro-batches of 4k."""


def run(out: Path, console: Console) -> TrainerMemoryResult:
    cases = []
    for name, tokens, rows, budget in CASES:
        with console.status(f"trainer step on {name}"):
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "rtrl.bench.trainer_memory",
                    str(tokens),
                    str(rows),
                    str(budget or 0),
                ],
                check=True,
                capture_output=True,
                text=True,
            )
        measured = json.loads(done.stdout.strip().splitlines()[-1])
        cases.append(
            MemoryCase(
                name,
                tokens,
                rows,
                budget or 0,
                round(measured["peak_mb"], 1),
                round(measured["step_s"], 2),
            )
        )
    result = TrainerMemoryResult(
        code=code_version(),
        cases=tuple(cases),
        whole_vs_micro_4k=round(cases[2].peak_mb / max(cases[4].peak_mb, 0.1), 2),
    )
    report.write(out, result)
    table = Table(title=f"bench trainer-memory -> {out}", title_justify="left")
    for column in ("batch", "peak MB above the model", "step s"):
        table.add_column(column, justify="right")
    for case in cases:
        table.add_row(case.case, f"{case.peak_mb:,.1f}", f"{case.step_s:.2f}")
    console.print(table)
    console.print(
        f"eight 4k rows: one forward takes {result.whole_vs_micro_4k}x the peak of 4k micro-batches"
    )
    return result


def main() -> None:
    """python -m rtrl.bench.trainer_memory TOKENS ROWS BUDGET (0: whole): one case's JSON."""
    tokens, rows, budget = (int(arg) for arg in sys.argv[1:4])
    print(json.dumps(measure_case(tokens, rows, budget or None)))


if __name__ == "__main__":
    main()
