"""What the trainer tells about its work: a typed report of each judged candidate, and
the heartbeat.

A candidate's verdict is acted on once (trainer/loop.py: published or refused). Its
StepReport is then told four ways: the attributes of its ``trainer.step`` span, the
TrainerStep record (on_step: to Kafka and the OpenTelemetry instruments,
trainer/metrics.py), the heartbeat and one log line. The heartbeat is read from another
thread, so it is replaced whole, never changed.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace

from opentelemetry import trace

from rtrl import otel
from rtrl.heartbeat import GateRefusal, TrainerBeat, TrainerMismatch
from rtrl.trainer import metrics as step_metrics
from rtrl.trainer.batch import Drop, TrainSample
from rtrl.trainer.candidate import Candidate
from rtrl.trainer.config import TrainerSettings
from rtrl.trainer.evaluation import Verdict
from rtrl.trainer.step import StepMetrics
from rtrl.v1 import trainer_pb2

log = logging.getLogger("trainer")
_tracer = trace.get_tracer("rtrl.trainer")

# Refusals kept in the heartbeat for `rtrl status`.
REFUSALS_SHOWN = 5


# Produced by Trainer.progress; consumed by Reporter (the heartbeat's counters).
@dataclass(frozen=True)
class Progress:
    step: int
    version: int
    """Treatment's newest published version."""
    rollouts_trained: int
    pending: int
    drops: Mapping[Drop, int]
    """Records not trained on since the process started, by reason."""


# Produced by StepReport.latency; consumed by Reporter.show (TrainerBeat's fields of the
# same names).
@dataclass(frozen=True)
class Latency:
    batch_wait_s: float | None = None
    step_s: float | None = None
    eval_s: float | None = None
    publish_s: float | None = None
    event_to_publish_s: float | None = None


# Produced by Trainer._finalize once a candidate is published or refused; consumed by its
# span and by Reporter.stepped (the step record, the heartbeat and the log line).
@dataclass(frozen=True)
class StepReport:
    candidate: Candidate
    verdict: Verdict
    lineage: str
    """The warm start the trainer's versions descend from (the step record's key)."""
    version: int
    """Treatment's version once the verdict was acted on: the candidate's if published."""
    eval_s: float
    """From the candidate going to the gate to its verdict being acted on."""
    publish_s: float | None
    """Shipping it to weight_sync; None: refused."""
    dropped: Mapping[str, int]
    """Records not trained on since the previous report, by reason."""
    traceparent: str
    """Of the candidate's ``trainer.step`` span."""
    ts_ms: int

    @property
    def published(self) -> bool:
        return self.verdict.accepted

    @property
    def newest(self) -> TrainSample:
        """The rollout with the newest event the candidate trained on."""
        return max(self.candidate.samples, key=lambda sample: sample.last_event_ts_ms)

    def timings(self) -> dict[str, float]:
        """Seconds per phase, in the order they ran (publish only if it was published)."""
        candidate = self.candidate
        timings = {
            "batch_wait": candidate.batch_wait_s,
            "step": candidate.step_s,
            "gate_wait": candidate.gate_wait_s,
            "eval": self.eval_s,
        }
        if self.publish_s is not None:
            timings["publish"] = self.publish_s
        return timings

    def span_attributes(self) -> dict[str, int | bool]:
        return {
            "rtrl.trainer.step": self.candidate.step,
            "rtrl.policy.base_version": self.candidate.base_version,
            "rtrl.policy.version": self.version,
            "rtrl.trainer.published": self.published,
            "rtrl.trainer.rollouts": len(self.candidate.samples),
        }

    def record(self, mismatch_threshold: float) -> trainer_pb2.TrainerStep:
        candidate = self.candidate
        return step_metrics.step_record(
            lineage=self.lineage,
            step=candidate.step,
            base_version=candidate.base_version,
            version=self.version if self.published else -1,
            ts_ms=self.ts_ms,
            metrics=candidate.metrics,
            verdict=self.verdict,
            staleness=candidate.staleness,
            dropped=self.dropped,
            timings=self.timings(),
            traceparent=self.traceparent,
            newest=self.newest,
            samples=candidate.samples,
            started_ts_ms=candidate.started_ns // 1_000_000,
            optimizer_steps=candidate.optimizer_steps,
            mismatch_threshold=mismatch_threshold,
        )

    def latency(self, now_s: float) -> Latency:
        """now_s: wall clock (s) the event-to-publish latency is measured to."""
        newest = self.newest.last_event_ts_ms
        return Latency(
            batch_wait_s=self.candidate.batch_wait_s,
            step_s=self.candidate.step_s,
            eval_s=self.eval_s,
            publish_s=self.publish_s,
            event_to_publish_s=now_s - newest / 1000 if self.published and newest else None,
        )


@contextmanager
def step_span(candidate: Candidate) -> Iterator[trace.Span]:
    """The candidate's ``trainer.step`` span, from when its training started, linked to the
    reward spans of its rollouts; current while the verdict is acted on."""
    span = _tracer.start_span(
        "trainer.step",
        links=otel.links(sample.traceparent for sample in candidate.samples),
        start_time=candidate.started_ns,
    )
    with trace.use_span(span, end_on_exit=True):
        yield span


class Reporter:
    """Keeps the heartbeat and tells each judged candidate (its step record and log line)."""

    def __init__(
        self,
        settings: TrainerSettings,
        on_step: Callable[[trainer_pb2.TrainerStep, int], None] | None = None,
    ) -> None:
        self.settings = settings
        self.on_step = on_step
        """Where step records go with treatment's version (trainer.metrics.StepExporter)."""
        self.beat = TrainerBeat()
        self.rewards: deque[float] = deque(maxlen=settings.reward_window_steps)
        """Mean rewards of the last published candidates."""
        self.refused = 0
        self.refusals: deque[GateRefusal] = deque(maxlen=REFUSALS_SHOWN)
        self._drops_reported: Counter[Drop] = Counter()

    def show(
        self,
        progress: Progress,
        metrics: StepMetrics | None = None,
        verdict: Verdict | None = None,
        latency: Latency = Latency(),
    ) -> None:
        """A new beat: these counters, and the step's metrics and verdict if it has them (else
        the previous beat's)."""
        previous = self.beat
        self.beat = TrainerBeat(
            step=progress.step,
            version=progress.version,
            rollouts_trained=progress.rollouts_trained,
            pending=progress.pending,
            reward_mean=sum(self.rewards) / len(self.rewards) if self.rewards else None,
            kl=metrics.kl if metrics else previous.kl,
            entropy=metrics.entropy if metrics else previous.entropy,
            grad_norm=metrics.grad_norm if metrics else previous.grad_norm,
            dropped_stale=progress.drops.get(Drop.STALE, 0),
            dropped={str(reason): n for reason, n in progress.drops.items()},
            gate=verdict.as_gate() if verdict else previous.gate,
            refused=self.refused,
            refusals=tuple(self.refusals),
            mismatch=self._mismatch(progress.step, metrics) or previous.mismatch,
            batch_wait_s=latency.batch_wait_s,
            step_s=latency.step_s,
            eval_s=latency.eval_s,
            publish_s=latency.publish_s,
            event_to_publish_s=latency.event_to_publish_s,
        )

    def _mismatch(self, step: int, metrics: StepMetrics | None) -> TrainerMismatch | None:
        """The step's train–inference mismatch for the beat; None if it measured no token."""
        if metrics is None or not metrics.mismatch.tokens:
            return None
        gap = metrics.mismatch
        return TrainerMismatch(
            step=step,
            mean=gap.mean,
            max=gap.max,
            over_threshold_share=gap.over_threshold_share,
            threshold=self.settings.mismatch_threshold,
            tokens=gap.tokens,
        )

    def refresh(self, pending: int, drops: Mapping[Drop, int]) -> None:
        """The beat's intake counters, between steps."""
        self.beat = replace(
            self.beat,
            pending=pending,
            dropped_stale=drops.get(Drop.STALE, 0),
            dropped={str(reason): n for reason, n in drops.items()},
        )

    def unreported(self, drops: Mapping[Drop, int]) -> dict[str, int]:
        """Records dropped since the last call, by reason (the next step record's share)."""
        delta = {
            str(reason): n - self._drops_reported[reason]
            for reason, n in drops.items()
            if n > self._drops_reported[reason]
        }
        self._drops_reported = Counter(drops)
        return delta

    def refusal(self, step: int, verdict: Verdict, rollouts: int) -> None:
        """The eval gate refused this step's candidate of this many rollouts."""
        self.refused += 1
        gate = verdict.as_gate()
        self.refusals.append(
            GateRefusal(
                step=step,
                ts_ms=int(time.time() * 1000),
                rollouts=rollouts,
                accepted=gate.accepted,
                candidate=gate.candidate,
                published=gate.published,
                control=gate.control,
                regressions=gate.regressions,
            )
        )

    def stepped(self, report: StepReport, progress: Progress) -> None:
        """Tell a judged candidate: the heartbeat, its step record, its log line."""
        metrics = report.candidate.metrics
        if report.published:
            self.rewards.append(metrics.reward_mean)
        self.show(progress, metrics, report.verdict, report.latency(time.time()))
        if self.on_step is not None:
            self.on_step(report.record(self.settings.mismatch_threshold), report.version)
        log_step(report, self.settings.max_staleness)


def log_step(report: StepReport, max_staleness: int) -> None:
    candidate, metrics = report.candidate, report.candidate.metrics
    log.info(
        "step %d -> %s rollouts %d in %d steps reward %.3f kl %.4f entropy %.3f "
        "grad_norm %.3f clipped %.3f stale %d eval %s %s",
        candidate.step,
        f"v{report.version}" if report.published else "refused",
        metrics.rollouts,
        candidate.optimizer_steps,
        metrics.reward_mean,
        metrics.kl,
        metrics.entropy,
        metrics.grad_norm,
        metrics.clipped_fraction,
        sum(s > max_staleness for s in candidate.staleness),
        report.verdict.candidate.as_dict(),
        " ".join(f"{phase} {seconds:.3f}s" for phase, seconds in report.timings().items()),
    )
