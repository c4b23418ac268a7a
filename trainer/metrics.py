"""Per-step metrics: one TrainerStep record per judged candidate, to Kafka (and from
there to ClickHouse through the analytics sink) and to OpenTelemetry.

OpenTelemetry gets the same numbers as instruments of the ``rtrl.trainer`` meter and
one ``trainer.step`` span per candidate, linked to the reward spans of the rollouts
it trained on (their W3C traceparent travels in the reward record). Without an SDK
configured (rtrl.otel) both are no-ops.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from confluent_kafka import Producer
from opentelemetry import metrics

from rtrl import kafka, signing, topics
from rtrl.trainer.batch import TrainSample
from rtrl.trainer.evaluation import Verdict
from rtrl.trainer.step import StepMetrics
from rtrl.v1 import trainer_pb2

log = logging.getLogger("trainer")

_meter = metrics.get_meter("rtrl.trainer")
_steps = _meter.create_counter(
    "rtrl.trainer.steps", unit="{step}", description="Candidates judged, by outcome"
)
_rollouts = _meter.create_counter(
    "rtrl.trainer.rollouts", unit="{rollout}", description="Rollouts in published versions"
)
_dropped = _meter.create_counter(
    "rtrl.trainer.dropped", unit="{rollout}", description="Reward records not trained on, by reason"
)
_staleness = _meter.create_histogram(
    "rtrl.trainer.staleness",
    unit="{version}",
    description="Versions between the trainer and a rollout's oldest token",
    explicit_bucket_boundaries_advisory=[0, 1, 2, 4, 8, 16, 32],
)
_duration = _meter.create_histogram(
    "rtrl.trainer.phase.duration", unit="s", description="Time per step phase"
)
_gauges = {
    name: _meter.create_gauge(f"rtrl.trainer.{name}", description=description)
    for name, description in (
        ("reward_mean", "Mean reward of the step's batch"),
        ("kl", "Token mean of log π − log π_ref (k1)"),
        ("entropy", "Token mean entropy of the policy on the batch (nats)"),
        ("clipped_fraction", "Share of tokens whose importance ratio hit the cap"),
        ("grad_norm", "Gradient norm before clipping"),
        ("version", "Treatment version the trainer holds"),
    )
}
_eval = _meter.create_gauge(
    "rtrl.trainer.eval.score", description="Eval-gate checker score of the candidate"
)
# Set only by a step that measured some tokens: a step that measured none leaves the last
# reading (mismatch_tokens says how many tokens the newest step covered, 0 included).
_mismatch = {
    name: _meter.create_gauge(f"rtrl.trainer.{name}", description=description)
    for name, description in (
        ("mismatch_mean", "Token mean |log π_trainer − log π_sampler| on on-policy tokens (nats)"),
        ("mismatch_max", "Largest |log π_trainer − log π_sampler| on on-policy tokens (nats)"),
        (
            "mismatch_over_threshold_share",
            "Share of on-policy tokens whose |Δ log p| exceeds mismatch_threshold",
        ),
    )
}
_mismatch_tokens = _meter.create_gauge(
    "rtrl.trainer.mismatch_tokens",
    description="Tokens the newest step measured the train–inference mismatch on",
)


def token_staleness(
    samples: Iterable[TrainSample], base_version: int
) -> list[trainer_pb2.TokenStaleness]:
    """The samples' generated tokens by versions between ``base_version`` and the one that
    sampled each."""
    counts = Counter(base_version - v for sample in samples for v in sample.token_versions)
    return [trainer_pb2.TokenStaleness(staleness=s, tokens=n) for s, n in sorted(counts.items())]


def staleness_buckets(staleness: Iterable[int]) -> list[trainer_pb2.StalenessBucket]:
    counts = Counter(staleness)
    return [trainer_pb2.StalenessBucket(staleness=s, rollouts=n) for s, n in sorted(counts.items())]


def step_record(
    *,
    lineage: str,
    step: int,
    base_version: int,
    version: int,
    ts_ms: int,
    metrics: StepMetrics,
    verdict: Verdict,
    staleness: Sequence[int],
    dropped: Mapping[str, int],
    timings: Mapping[str, float],
    traceparent: str = "",
    newest: TrainSample | None = None,
    samples: Sequence[TrainSample] = (),
    started_ts_ms: int = 0,
    optimizer_steps: int = 1,
    mismatch_threshold: float = 0.0,
) -> trainer_pb2.TrainerStep:
    """newest: the rollout with the newest event the candidate trained on; its instants
    split the candidate's event -> publish latency into phases (see TrainerStep)."""
    gap = metrics.mismatch
    return trainer_pb2.TrainerStep(
        step_id=f"{lineage}:{step}",
        lineage=lineage,
        step=step,
        base_version=base_version,
        version=version,
        published=verdict.accepted,
        ts_ms=ts_ms,
        rollouts=metrics.rollouts,
        tokens=metrics.tokens,
        reward_mean=metrics.reward_mean,
        loss=metrics.loss,
        kl=metrics.kl,
        entropy=metrics.entropy,
        clipped_fraction=metrics.clipped_fraction,
        ratio_mean=metrics.ratio_mean,
        grad_norm=metrics.grad_norm,
        advantage_abs_mean=metrics.advantage_abs_mean,
        staleness=staleness_buckets(staleness),
        token_staleness=token_staleness(samples, base_version),
        dropped=dict(dropped),
        eval_candidate=verdict.candidate.as_dict(),
        eval_published=verdict.published.as_dict(),
        eval_regressions=list(verdict.regressions),
        traceparent=traceparent,
        trained_through_event_ts_ms=newest.last_event_ts_ms if newest else 0,
        newest_reward_ts_ms=newest.reward_ts_ms if newest else 0,
        newest_read_ts_ms=newest.read_ts_ms if newest else 0,
        started_ts_ms=started_ts_ms,
        optimizer_steps=optimizer_steps,
        mismatch_mean=gap.mean,
        mismatch_max=gap.max,
        mismatch_over_threshold_share=gap.over_threshold_share,
        mismatch_tokens=gap.tokens,
        mismatch_threshold=mismatch_threshold,
        **{f"{phase}_s": seconds for phase, seconds in timings.items()},
    )


def record_instruments(record: trainer_pb2.TrainerStep, version: int) -> None:
    outcome = {"outcome": "published" if record.published else "refused"}
    _steps.add(1, outcome)
    if record.published:
        _rollouts.add(record.rollouts)
    for reason, n in record.dropped.items():
        if n:
            _dropped.add(n, {"reason": reason})
    for bucket in record.staleness:
        for _ in range(bucket.rollouts):
            _staleness.record(bucket.staleness)
    for phase in ("batch_wait", "step", "eval", "publish"):
        _duration.record(getattr(record, f"{phase}_s"), {"phase": phase})
    for name, gauge in _gauges.items():
        gauge.set(
            version if name == "version" else getattr(record, name),
            outcome if name != "version" else None,
        )
    for checker, score in record.eval_candidate.items():
        _eval.set(score, {"checker": checker, **outcome})
    _mismatch_tokens.set(record.mismatch_tokens)
    if record.mismatch_tokens:
        for name, gauge in _mismatch.items():
            gauge.set(getattr(record, name))


class StepExporter:
    """Sends each TrainerStep to Kafka (idempotent producer, keyed by lineage) and to
    the OpenTelemetry instruments. Sends are asynchronous: a step never waits on them.

    Each record is signed (``signer``: the trainer's manifest key, purpose "trainer-step"),
    since the analytics sink stores only steps that verify: the training report reads them."""

    def __init__(
        self, producer: Producer, signer: signing.Signer, topic: str = topics.TRAINER_STEPS
    ) -> None:
        if signer.purpose is not signing.Purpose.TRAINER_STEP:
            raise ValueError(f"a trainer step is signed for its own purpose, not {signer.purpose}")
        self._producer = producer
        self._signer = signer
        self._topic = topic
        self.failed = 0

    def __call__(self, record: trainer_pb2.TrainerStep, version: int) -> None:
        record_instruments(record, version)
        value = record.SerializeToString()
        self._producer.produce(
            self._topic,
            value,
            key=record.lineage.encode(),
            headers=kafka.kafka_headers(self._signer.headers(value)),
            on_delivery=self._delivered,
        )
        self._producer.poll(0)

    def dead_letter(self, message, reason: str) -> None:
        """A consumed record the trainer refused to train on, to the reward DLQ with the reason
        in its headers (the analytics sink keeps it in dead_letters)."""
        headers = [
            ("reason", f"trainer: {reason}".encode()),
            ("source_topic", message.topic().encode()),
        ]
        self._producer.produce(
            topics.REWARD_DLQ,
            message.value(),
            key=message.key(),
            headers=headers,
            on_delivery=self._delivered,
        )
        self._producer.poll(0)

    def _delivered(self, err, msg) -> None:
        if err is not None:
            self.failed += 1
            log.warning(
                "trainer record not delivered to %s: %s",
                msg.topic() if msg is not None else self._topic,
                err,
            )

    def flush(self, timeout_s: float = 10.0) -> None:
        if self._producer.flush(timeout_s):
            log.warning("trainer step records still unsent after %.0f s", timeout_s)
