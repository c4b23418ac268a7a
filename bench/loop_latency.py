"""Event -> live, the figure `rtrl bench loop` reports, as pure functions over what the
stack recorded: when a version is live on every worker, where its seconds go (PHASES,
from its TrainerStep record), whether the latency trends upward over the run, and what
the trainer did with the rewards it read. bench/loop.py reads the records and runs them.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from rtrl.v1 import trainer_pb2

PHASES = ("reward", "queue", "batch_wait", "step", "gate_wait", "eval", "publish", "live")
"""event -> live of a version's newest rollout, in order: its last event until the joiner
wrote its reward (the reward window), until the trainer read it (queued in Kafka behind
the trainer), until its candidate's training started, training, waiting for the previous
candidate's verdict (a gate beside training), the eval gate until its verdict was acted
on, the publish, and from the manifest until every worker serves the version."""
RISE_TOLERANCE_S = 1.0
"""A fitted rise of event -> live over the run larger than this (and beyond twice its
standard error) is an upward trend."""


@dataclass(frozen=True)
class VersionLatency:
    version: int
    trained_through_event_ts_ms: int
    published_ts_ms: int
    live_ts_ms: int

    @property
    def event_to_live_s(self) -> float:
        return (self.live_ts_ms - self.trained_through_event_ts_ms) / 1000

    @property
    def publish_to_live_s(self) -> float:
        return (self.live_ts_ms - self.published_ts_ms) / 1000


# Read from a published candidate's TrainerStep record; consumed by phases().
@dataclass(frozen=True)
class StepTimes:
    version: int
    newest_reward_ts_ms: int
    newest_read_ts_ms: int
    started_ts_ms: int
    step_s: float
    eval_s: float
    publish_s: float
    rollouts: int
    optimizer_steps: int
    gate_wait_s: float = 0.0

    @classmethod
    def of(cls, record: trainer_pb2.TrainerStep) -> StepTimes:
        return cls(
            record.version,
            record.newest_reward_ts_ms,
            record.newest_read_ts_ms,
            record.started_ts_ms,
            record.step_s,
            record.eval_s,
            record.publish_s,
            record.rollouts,
            record.optimizer_steps,
            record.gate_wait_s,
        )


def phases(row: VersionLatency, step: StepTimes) -> dict[str, float]:
    """Seconds per phase of PHASES, plus what they leave unaccounted (the manifest is
    written inside the publish phase, so a few milliseconds are counted twice)."""
    seconds = {
        "reward": (step.newest_reward_ts_ms - row.trained_through_event_ts_ms) / 1000,
        "queue": (step.newest_read_ts_ms - step.newest_reward_ts_ms) / 1000,
        "batch_wait": (step.started_ts_ms - step.newest_read_ts_ms) / 1000,
        "step": step.step_s,
        "gate_wait": step.gate_wait_s,
        "eval": step.eval_s,
        "publish": step.publish_s,
        "live": row.publish_to_live_s,
    }
    seconds["unaccounted"] = row.event_to_live_s - sum(seconds.values())
    return seconds


# Produced by phase_breakdown, per phase; part of LoopSummary.phases_s.
@dataclass(frozen=True)
class PhaseStats:
    """Seconds one phase took over the versions."""

    p50: float
    p95: float
    mean: float


def phase_breakdown(
    rows: Sequence[VersionLatency], steps: Sequence[StepTimes]
) -> dict[str, PhaseStats]:
    """p50, p95 and mean seconds per phase over the versions that have a step record
    with the newest rollout's instants (records from an older trainer have none)."""
    by_version = {step.version: step for step in steps if step.newest_reward_ts_ms > 0}
    split = [phases(row, by_version[row.version]) for row in rows if row.version in by_version]
    if not split:
        return {}
    return {
        name: PhaseStats(
            p50=round(statistics.median(p[name] for p in split), 3),
            p95=round(_quantile([p[name] for p in split], 0.95), 3),
            mean=round(statistics.fmean(p[name] for p in split), 3),
        )
        for name in (*PHASES, "unaccounted")
    }


# Produced by trend; part of LoopSummary, read by plot_png and _print.
@dataclass(frozen=True)
class Trend:
    """event -> live against publish time, in minutes from the first publish."""

    slope_s_per_min: float
    """The least-squares slope."""
    slope_stderr_s_per_min: float
    rise_over_run_s: float
    """The slope times the run's span of publish times."""
    bucket_s: float
    p50_per_bucket_s: tuple[float | None, ...]
    """The median event -> live per bucket_s of the run; None for a bucket without versions."""
    rising: bool
    """The rise exceeds RISE_TOLERANCE_S and twice its standard error."""


def trend(rows: Sequence[VersionLatency], bucket_s: float = 60.0) -> Trend | None:
    """event -> live against publish time: the least-squares slope (s per minute) with its
    standard error, the rise it fits over the run, the median per bucket_s of the run
    (from the first publish), and whether that is an upward trend; None for fewer than
    three versions or all published at once."""
    if len(rows) < 3:
        return None
    t0 = min(r.published_ts_ms for r in rows)
    xs = [(r.published_ts_ms - t0) / 60_000 for r in rows]
    ys = [r.event_to_live_s for r in rows]
    x_mean, y_mean = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - x_mean) ** 2 for x in xs)
    if sxx == 0:
        return None
    slope = sum((x - x_mean) * (y - y_mean) for x, y in zip(xs, ys, strict=True)) / sxx
    residual = sum((y - y_mean - slope * (x - x_mean)) ** 2 for x, y in zip(xs, ys, strict=True))
    stderr = math.sqrt(residual / (len(rows) - 2) / sxx)
    rise = slope * (max(xs) - min(xs))
    buckets: dict[int, list[float]] = {}
    for r in rows:
        buckets.setdefault(int((r.published_ts_ms - t0) / 1000 // bucket_s), []).append(
            r.event_to_live_s
        )
    return Trend(
        slope_s_per_min=round(slope, 3),
        slope_stderr_s_per_min=round(stderr, 3),
        rise_over_run_s=round(rise, 3),
        bucket_s=bucket_s,
        p50_per_bucket_s=tuple(
            round(statistics.median(buckets[b]), 3) if b in buckets else None
            for b in range(max(buckets) + 1)
        ),
        rising=rise > RISE_TOLERANCE_S and slope > 2 * stderr,
    )


def live_times(applied: dict[int, dict[str, int]]) -> dict[int, int]:
    """Version -> when every worker served it or a newer one.

    applied maps version -> {worker_id: unix ms it went live on that worker}.
    """
    workers = {w for per_version in applied.values() for w in per_version}
    result = {}
    for version in applied:
        per_worker = []
        for worker in workers:
            times = [
                ts
                for v, pw in applied.items()
                if v >= version
                for w, ts in pw.items()
                if w == worker
            ]
            if not times:
                break
            per_worker.append(min(times))
        else:
            result[version] = max(per_worker)
    return result


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else float("nan")


# Produced by summarize, one per version live on every worker; part of LoopSummary.versions,
# read by plot_png.
@dataclass(frozen=True)
class VersionResult:
    version: int
    trained_through_event_ts_ms: int
    """Event time of the last event of the newest rollout the version trained on."""
    published_ts_ms: int
    """When its manifest was written."""
    live_ts_ms: int
    """When every worker served it or a newer version."""
    event_to_live_s: float
    rollouts: int | None
    """Rollouts it trained on; None without its step record."""
    optimizer_steps: int | None
    """None without its step record."""
    phases_s: dict[str, float] | None
    """Seconds per phase of PHASES, plus "unaccounted"; None without a step record that
    has the newest rollout's instants."""


# Produced by summarize; the first fields of LoopResult, read by the loop test.
@dataclass(frozen=True)
class LoopSummary:
    p50_event_to_live_s: float
    """Over the versions live on every worker; NaN when there is none."""
    p95_event_to_live_s: float
    versions_published: int
    """Manifests written during the run."""
    versions_live_on_every_worker: int
    p50_publish_to_live_s: float | None
    """From the manifest until every worker serves the version; None when none did."""
    reward_window_s: float
    """The joiner's window: the floor of event -> live."""
    p50_event_to_live_vs_reward_window: float | None
    phases_s: dict[str, PhaseStats]
    """Per phase of PHASES, plus "unaccounted"; empty when no version has a step record
    with its newest rollout's instants."""
    trend: Trend | None
    """None for fewer than three versions."""
    versions: tuple[VersionResult, ...]


def summarize(
    rows: list[VersionLatency],
    versions_published: int,
    reward_window_s: float,
    steps: Sequence[StepTimes] = (),
) -> LoopSummary:
    e2l = [r.event_to_live_s for r in rows]
    published = {s.version: s for s in steps}
    p2l = [r.publish_to_live_s for r in rows]
    p50 = statistics.median(e2l) if e2l else float("nan")
    return LoopSummary(
        p50_event_to_live_s=round(p50, 3),
        p95_event_to_live_s=round(_quantile(e2l, 0.95), 3),
        versions_published=versions_published,
        versions_live_on_every_worker=len(rows),
        p50_publish_to_live_s=round(statistics.median(p2l), 3) if p2l else None,
        reward_window_s=reward_window_s,
        p50_event_to_live_vs_reward_window=round(p50 / reward_window_s, 2)
        if reward_window_s
        else None,
        phases_s=phase_breakdown(rows, steps),
        trend=trend(rows),
        versions=tuple(_version_row(r, published.get(r.version)) for r in rows),
    )


def _version_row(row: VersionLatency, step: StepTimes | None) -> VersionResult:
    split = None
    if step is not None and step.newest_reward_ts_ms:
        split = {name: round(seconds, 3) for name, seconds in phases(row, step).items()}
    return VersionResult(
        version=row.version,
        trained_through_event_ts_ms=row.trained_through_event_ts_ms,
        published_ts_ms=row.published_ts_ms,
        live_ts_ms=row.live_ts_ms,
        event_to_live_s=row.event_to_live_s,
        rollouts=step.rollouts if step is not None else None,
        optimizer_steps=step.optimizer_steps if step is not None else None,
        phases_s=split,
    )


# Produced by intake; part of LoopResult, read by the loop test.
@dataclass(frozen=True)
class Intake:
    """What the trainer did with the rewards it read during the run."""

    rollouts_trained: int
    """In published and refused candidates alike."""
    dropped: dict[str, int]
    """Rollouts read but not trained, by reason (control_arm, shed, duplicate...)."""
    trained_share_of_treatment: float | None
    """rollouts_trained over the treatment arm's rollouts read; None when there were none."""
    token_staleness: dict[int, int] = dataclasses.field(default_factory=dict)
    """Generated tokens trained on, by versions between the candidate's base and the version
    that sampled each (published and refused candidates alike)."""
    newest_token_share: float | None = None
    """Of those tokens, the share sampled by the version the candidate was trained from."""


def intake(records: Sequence[trainer_pb2.TrainerStep]) -> Intake:
    """What the trainer did with the rewards it read during the run: rollouts trained (in
    published and refused candidates alike), rollouts dropped by reason, and the share of
    the treatment arm's rollouts it trained on (a shedding trainer's price for freshness)."""
    dropped: Counter[str] = Counter()
    for record in records:
        dropped.update(dict(record.dropped))
    trained = sum(record.rollouts for record in records)
    treatment = trained + sum(n for reason, n in dropped.items() if reason != "control_arm")
    tokens: Counter[int] = Counter()
    for record in records:
        tokens.update({bucket.staleness: bucket.tokens for bucket in record.token_staleness})
    total = sum(tokens.values())
    return Intake(
        rollouts_trained=trained,
        dropped=dict(sorted(dropped.items())),
        trained_share_of_treatment=round(trained / treatment, 3) if treatment else None,
        token_staleness=dict(sorted(tokens.items())),
        newest_token_share=round(tokens[0] / total, 3) if total else None,
    )
