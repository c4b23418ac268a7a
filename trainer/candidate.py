"""A candidate between the end of its training and its verdict, and the thread that judges it.

The eval gate samples the held-out suite once per candidate. Inline, training stops for
that long; on a thread of its own, the next candidate trains on top of this one while
it is judged. What ships is always exactly what was judged: the candidate's weights
are copied when its training ends, the copy is judged on a model of the judge's own,
and the copy is what weight_sync publishes. The next candidate is speculative until
the verdict: if its base is refused, the learner returns to the published state and
the next candidate's rollouts are trained again on it (they were never journaled, and
the weights that held them are gone, so no rollout is trained twice).
"""

from __future__ import annotations

import enum
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from rtrl.policy import load_weights
from rtrl.trainer.batch import TrainSample
from rtrl.trainer.evaluation import EvalGate, Verdict
from rtrl.trainer.step import StepMetrics


# Produced by Trainer.train_pending when a candidate's optimizer steps end; consumed by
# Trainer._finalize once its verdict is in.
@dataclass(frozen=True)
class Candidate:
    step: int
    base_version: int
    """The published version it was trained from."""
    samples: tuple[TrainSample, ...]
    positions: dict[str, int]
    """Consumer positions right after its records: where a restart resumes once it is final."""
    metrics: StepMetrics
    optimizer_steps: int
    staleness: tuple[int, ...]
    started_ns: int
    """Wall clock (ns) when its training started."""
    batch_wait_s: float
    step_s: float
    gate_wait_s: float
    """Waiting for the previous candidate's verdict before this one could go to the gate."""
    judging_since: float
    """Monotonic time it went to the gate."""
    weights: dict[str, torch.Tensor]
    """The weights judged, and published if accepted."""
    optimizer_state: dict[str, Any] | None
    """The optimizer state that goes with them (None: the learner still holds it)."""
    verdict: Future[Verdict]


class Settled(enum.Enum):
    """What acting on the verdict of the candidate at the gate came to (Trainer._settle)."""

    NOTHING = "nothing"  # no candidate at the gate, or its verdict is not in yet
    PUBLISHED = "published"
    REFUSED = "refused"  # the learner is back on the published state


class Judge:
    """Runs the eval gate on copies of candidates, on a thread of its own or inline."""

    def __init__(self, gate: EvalGate, model: torch.nn.Module, *, background: bool) -> None:
        self.gate = gate
        self.model = model
        self._pool = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="eval-gate")
            if background
            else None
        )

    def submit(self, weights: dict[str, torch.Tensor]) -> Future[Verdict]:
        """Judge these weights against the gate's current references. Call only once the
        previous verdict is in: its model is reused."""
        load_weights(self.model, weights)
        if self._pool is not None:
            return self._pool.submit(self.gate.judge, self.model)
        done: Future[Verdict] = Future()
        done.set_result(self.gate.judge(self.model))
        return done

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
