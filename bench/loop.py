"""`rtrl bench loop`: how fast a user's behaviour becomes weights the fleet serves.

For every treatment version published during the run: the event time of the last
event of the newest rollout it trained on (the manifest records it) until every
inference worker serves that version or a newer one (workers record the moment a
version goes live; a worker may skip straight to a newer version, which counts).
The reward window is the floor of this latency, so the result is also reported as a
ratio against it.

Where the seconds go: each published candidate's TrainerStep record (topic
rl.trainer.steps.v1) carries the wall-clock instants of its newest rollout (reward
written by the joiner, read by the trainer, training started) and the step, eval and
publish durations, which split event -> live into PHASES. The trend is a least-squares
line of event -> live over publish time plus per-minute medians: a trainer that falls
behind its traffic shows as a rising line, whatever its median.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import subprocess
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from rich.console import Console
from rich.table import Table

from rtrl.bench import report
from rtrl.v1 import trainer_pb2, weights_pb2

ARM = "treatment"
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


def _text(reply: bytes | str) -> str:
    """A Redis reply as text (the client is opened without decode_responses)."""
    return reply.decode() if isinstance(reply, bytes) else reply


def _manifest(client: redis.Redis, key: bytes) -> weights_pb2.Manifest:
    raw = client.get(key)
    if not isinstance(raw, bytes):
        raise RuntimeError(f"manifest {key!r} was deleted after it was listed")
    return weights_pb2.Manifest.FromString(raw)


def collect(redis_url: str, since_ms: int) -> list[VersionLatency]:
    client = redis.Redis.from_url(redis_url)
    try:
        applied: dict[int, dict[str, int]] = {}
        for key in client.scan_iter(f"rtrl:applied:{ARM}:*"):
            version = int(key.decode().rsplit(":", 1)[1])
            applied[version] = {_text(w): int(ts) for w, ts in client.hgetall(key).items()}
        live = live_times(applied)
        rows = []
        for key in client.scan_iter(f"rtrl:ws:{ARM}:manifest:*"):
            manifest = _manifest(client, key)
            if manifest.trained_through_event_ts_ms <= 0 or manifest.created_ts_ms < since_ms:
                continue
            if manifest.version in live:
                rows.append(
                    VersionLatency(
                        manifest.version,
                        manifest.trained_through_event_ts_ms,
                        manifest.created_ts_ms,
                        live[manifest.version],
                    )
                )
        return sorted(rows, key=lambda r: r.version)
    finally:
        client.close()


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


def read_step_records(
    kafka_bootstrap: str, since_ms: int, timeout_s: float = 30.0
) -> list[trainer_pb2.TrainerStep]:
    """Every candidate's step record (published or refused) written since since_ms, read to each partition's EOF."""
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    from rtrl import topics
    from rtrl.config import StackSettings
    from rtrl.kafka import consumer_config, partitions

    settings = StackSettings(kafka_bootstrap=kafka_bootstrap)
    tps = partitions(settings, (topics.TRAINER_STEPS,))
    consumer = Consumer(
        consumer_config(settings, f"bench-loop-{since_ms}", **{"enable.partition.eof": True})
    )
    try:
        consumer.assign([TopicPartition(tp.topic, tp.partition, 0) for tp in tps])
        waiting = {tp.partition for tp in tps}
        records = []
        deadline = time.monotonic() + timeout_s
        while waiting and time.monotonic() < deadline:
            for message in consumer.consume(1000, timeout=0.2):
                error = message.error()
                if error is not None:
                    if error.code() != KafkaError._PARTITION_EOF:
                        raise RuntimeError(error)
                    waiting.discard(message.partition())
                    continue
                value = message.value()
                assert value is not None  # the trainer writes every step record with a value
                record = trainer_pb2.TrainerStep.FromString(value)
                if record.ts_ms >= since_ms:
                    records.append(record)
        return records
    finally:
        consumer.close()


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


def intake(records: Sequence[trainer_pb2.TrainerStep]) -> Intake:
    """What the trainer did with the rewards it read during the run: rollouts trained (in
    published and refused candidates alike), rollouts dropped by reason, and the share of
    the treatment arm's rollouts it trained on (a shedding trainer's price for freshness)."""
    dropped: Counter[str] = Counter()
    for record in records:
        dropped.update(dict(record.dropped))
    trained = sum(record.rollouts for record in records)
    treatment = trained + sum(n for reason, n in dropped.items() if reason != "control_arm")
    return Intake(
        rollouts_trained=trained,
        dropped=dict(sorted(dropped.items())),
        trained_share_of_treatment=round(trained / treatment, 3) if treatment else None,
    )


def _git(*args: str) -> str:
    repo = Path(__file__).resolve().parent.parent
    return subprocess.run(
        ["git", *args], cwd=repo, capture_output=True, text=True, check=False
    ).stdout.strip()


def _provenance() -> tuple[str, bool]:
    """The commit measured, and whether tracked files differed from it."""
    return (
        _git("rev-parse", "--short", "HEAD"),
        bool(_git("status", "--porcelain", "--untracked-files=no")),
    )


# Produced by run from TrainerSettings; part of LoopResult.
@dataclass(frozen=True)
class TrainerRun:
    """What the stack's trainer ran with: the embedded defaults under the environment."""

    eval_gate: str
    eval_tasks: int
    batch_size: int
    steps_per_candidate: int
    overlap_eval: bool
    when_behind: str


# Produced by run; written to bench/results/loop.json; read by plot_png, _print and the README.
@dataclass(frozen=True)
class LoopResult(LoopSummary):
    intake: Intake
    latest_version: int
    """The arm's latest version at the end of the run; -1 for none."""
    minutes: float
    command: str
    """The command that reproduces the run."""
    commit: str
    """The commit measured; empty outside a git checkout."""
    tree_dirty: bool
    """Tracked files differed from the commit."""
    load_avg_1_5_15_before: tuple[float, ...]
    load_avg_1_5_15_after: tuple[float, ...]
    cpus: int | None
    trainer: TrainerRun


def run(state_dir: Path, duration_s: float, out: Path, console: Console) -> LoopResult:
    from rtrl.ops.demo import run_product
    from rtrl.ops.health import running_stack
    from rtrl.ops.lifecycle import down, up
    from rtrl.ops.stack import embedded_trainer_env
    from rtrl.reward_stream.config import RewardStreamSettings
    from rtrl.trainer.config import TrainerSettings

    started_here = running_stack(state_dir) is None
    stack = up(state_dir, console)
    load_before = os.getloadavg()
    try:
        since_ms = int(time.time() * 1000)
        run_product(stack, duration_s, console)
        time.sleep(3)  # let the last versions reach every worker
        load_after = os.getloadavg()
        rows = collect(stack.redis_url, since_ms)
        records = read_step_records(stack.kafka_bootstrap, since_ms)
        client = redis.Redis.from_url(stack.redis_url)
        latest = int(client.get(f"rtrl:ws:{ARM}:latest") or -1)
        published = sum(
            1
            for key in client.scan_iter(f"rtrl:ws:{ARM}:manifest:*")
            if _manifest(client, key).created_ts_ms >= since_ms
        )
        client.close()
    finally:
        if started_here:
            down(state_dir, console)
    steps = [StepTimes.of(record) for record in records if record.published]
    summary = summarize(rows, published, RewardStreamSettings().window_s, steps)
    # What the stack's trainer ran with: the embedded defaults under whatever the environment set.
    # Field values go in as the environment's strings, for pydantic to parse (hence Any).
    fields: dict[str, Any] = {
        name.removeprefix("RTRL_TRAINER_").lower(): value
        for name, value in embedded_trainer_env(os.environ).items()
    }
    trainer = TrainerSettings(**fields)
    commit, tree_dirty = _provenance()
    result = LoopResult(
        # The summary's own fields, as they are (asdict would make dicts of its records).
        **vars(summary),
        intake=intake(records),
        latest_version=latest,
        minutes=round(duration_s / 60, 2),
        command=f"rtrl bench loop --minutes {duration_s / 60:g}",
        commit=commit,
        tree_dirty=tree_dirty,
        load_avg_1_5_15_before=tuple(round(x, 2) for x in load_before),
        load_avg_1_5_15_after=tuple(round(x, 2) for x in load_after),
        cpus=os.cpu_count(),
        trainer=TrainerRun(
            eval_gate="on, every candidate",
            eval_tasks=trainer.eval_tasks,
            batch_size=trainer.batch_size,
            steps_per_candidate=trainer.steps_per_candidate,
            overlap_eval=trainer.overlap_eval,
            when_behind=trainer.when_behind,
        ),
    )
    report.write(out, result)
    plot = plot_png(result, out.with_suffix(".png"))
    _print(result, duration_s, out, plot, console)
    return result


def plot_png(result: LoopResult, path: Path) -> Path | None:
    """event -> live per version over the run (with the per-minute medians and the fitted
    line) above each version's phases stacked; None when there is nothing to draw."""
    from matplotlib.figure import Figure

    versions = result.versions
    if not versions:
        return None
    t0 = min(v.published_ts_ms for v in versions)
    minutes = [(v.published_ts_ms - t0) / 60_000 for v in versions]
    figure = Figure(figsize=(9, 6.5))
    top, bottom = figure.subplots(2, 1, sharex=True)
    top.scatter(
        minutes, [v.event_to_live_s for v in versions], s=8, label="event -> live per version"
    )
    trend_fit = result.trend
    if trend_fit is not None:
        medians = trend_fit.p50_per_bucket_s
        width = trend_fit.bucket_s / 60
        top.step(
            [i * width for i in range(len(medians))],
            medians,
            where="post",
            color="black",
            label="median per minute",
        )
        mean_x, mean_y = (
            statistics.fmean(minutes),
            statistics.fmean(v.event_to_live_s for v in versions),
        )
        slope = trend_fit.slope_s_per_min
        top.plot(
            [0, max(minutes)],
            [mean_y - slope * mean_x, mean_y + slope * (max(minutes) - mean_x)],
            "r--",
            label=f"fit {slope:+.2f} s/min",
        )
    top.set_ylabel("seconds")
    top.legend(loc="upper left", fontsize=8)
    top.set_title(f"rtrl bench loop at {result.commit}: event -> live", fontsize=10)
    split = [
        (m, v.phases_s) for m, v in zip(minutes, versions, strict=True) if v.phases_s is not None
    ]
    base = [0.0] * len(split)
    for name in PHASES:
        heights = [max(p[name], 0.0) for _, p in split]
        bottom.bar([m for m, _ in split], heights, bottom=base, width=0.02, label=name)
        base = [b + h for b, h in zip(base, heights, strict=True)]
    bottom.set_xlabel("minutes into the run (publish time)")
    bottom.set_ylabel("seconds per phase")
    bottom.legend(loc="upper left", fontsize=7, ncols=4)
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    return path


def _print(
    result: LoopResult, duration_s: float, out: Path, plot: Path | None, console: Console
) -> None:
    table = Table(title=f"bench loop ({duration_s / 60:.1f} min) -> {out}", title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for field in dataclasses.fields(result):
        if field.name not in ("versions", "phases_s", "trend", "trainer", "intake"):
            value = getattr(result, field.name)
            # Shown as they are in the JSON: a tuple as a list.
            table.add_row(field.name, str(list(value) if isinstance(value, tuple) else value))
    console.print(table)
    if result.phases_s:
        phase_table = Table(
            title="where event -> live goes (newest rollout of each version)", title_justify="left"
        )
        for column in ("phase", "p50 s", "p95 s", "mean s"):
            phase_table.add_column(column, justify="left" if column == "phase" else "right")
        for name, stats in result.phases_s.items():
            phase_table.add_row(name, f"{stats.p50:.3f}", f"{stats.p95:.3f}", f"{stats.mean:.3f}")
        console.print(phase_table)
    taken = result.intake
    share = taken.trained_share_of_treatment
    console.print(
        f"trainer: {taken.rollouts_trained} rollouts trained ({share} of the treatment arm's), "
        f"dropped {taken.dropped}; settings {dataclasses.asdict(result.trainer)}"
    )
    if result.trend is not None:
        t = result.trend
        rising = "RISING" if t.rising else "no upward trend"
        console.print(
            f"trend: {t.slope_s_per_min:+.3f} ± {t.slope_stderr_s_per_min:.3f} s/min, "
            f"fitted rise {t.rise_over_run_s:+.2f} s over the run ({rising}); "
            f"median per minute {list(t.p50_per_bucket_s)}"
        )
    if plot is not None:
        console.print(f"plot: {plot}")
