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

Those definitions are bench/loop_latency.py's; this module reads the stack's records,
runs them and writes the result.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from rich.console import Console
from rich.table import Table

from rtrl.bench import report
from rtrl.bench.loop_latency import (
    PHASES,
    Intake,
    LoopSummary,
    StepTimes,
    VersionLatency,
    intake,
    live_times,
    summarize,
)
from rtrl.v1 import trainer_pb2, weights_pb2

ARM = "treatment"


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


# Produced by trainer_run from TrainerSettings; part of LoopResult.
@dataclass(frozen=True)
class TrainerRun:
    """What the stack's trainer ran with: the embedded defaults under the environment."""

    eval_gate: str
    eval_tasks: int
    batch_size: int
    steps_per_candidate: int
    overlap_eval: bool
    when_behind: str


# Produced by run; written to bench/results/loop.json; read by plot_png, _print and docs/benchmarks.md.
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


# Produced by observe; read by run.
@dataclass(frozen=True)
class Observed:
    """What the stack recorded during the run."""

    rows: list[VersionLatency]
    """Treatment versions published during the run and live on every worker."""
    records: list[trainer_pb2.TrainerStep]
    """Every candidate's step record written during the run."""
    latest_version: int
    """The arm's latest version at the end of the run; -1 for none."""
    versions_published: int
    """Manifests written during the run."""


def observe(redis_url: str, kafka_bootstrap: str, since_ms: int) -> Observed:
    rows = collect(redis_url, since_ms)
    records = read_step_records(kafka_bootstrap, since_ms)
    with closing(redis.Redis.from_url(redis_url)) as client:
        latest = int(client.get(f"rtrl:ws:{ARM}:latest") or -1)
        published = sum(
            1
            for key in client.scan_iter(f"rtrl:ws:{ARM}:manifest:*")
            if _manifest(client, key).created_ts_ms >= since_ms
        )
    return Observed(rows, records, latest, published)


def trainer_run() -> TrainerRun:
    """What the stack's trainer ran with: the embedded defaults under whatever the
    environment set."""
    from rtrl.ops.stack import embedded_trainer_env
    from rtrl.trainer.config import TrainerSettings

    # Field values go in as the environment's strings, for pydantic to parse (hence Any):
    # the embedded defaults, then whatever else the environment sets (the agent's settings).
    env = {
        **embedded_trainer_env(os.environ),
        **{k: v for k, v in os.environ.items() if k.startswith("RTRL_TRAINER_")},
    }
    fields: dict[str, Any] = {
        name.removeprefix("RTRL_TRAINER_").lower(): value
        for name, value in env.items()
        if name.removeprefix("RTRL_TRAINER_").lower() in TrainerSettings.model_fields
    }
    trainer = TrainerSettings(**fields)
    return TrainerRun(
        eval_gate="on, every candidate",
        eval_tasks=trainer.eval_tasks,
        batch_size=trainer.batch_size,
        steps_per_candidate=trainer.steps_per_candidate,
        overlap_eval=trainer.overlap_eval,
        when_behind=trainer.when_behind,
    )


def run(
    state_dir: Path, duration_s: float, out: Path, console: Console, product: str = "edits"
) -> LoopResult:
    """``product``: "edits" (the single-turn product) or "agent" (the agentic one, on a fresh
    run of the agent's warm start: ops.demo.prepare_agent)."""
    from rtrl.ops.demo import prepare_agent, run_product
    from rtrl.ops.health import running_stack
    from rtrl.ops.lifecycle import down, up
    from rtrl.reward_stream.config import RewardStreamSettings

    agent = product == "agent"
    started_here = running_stack(state_dir) is None
    if agent and not started_here:
        raise RuntimeError("bench loop --product agent starts a fresh run: `rtrl down` first")
    model_dir = prepare_agent(state_dir, console) if agent else None
    stack = up(state_dir, console, fresh=agent, model_dir=model_dir)
    load_before = os.getloadavg()
    try:
        since_ms = int(time.time() * 1000)
        run_product(stack, duration_s, console, agent=agent)
        time.sleep(3)  # let the last versions reach every worker
        load_after = os.getloadavg()
        seen = observe(stack.redis_url_as("operator"), stack.kafka_bootstrap, since_ms)
    finally:
        if started_here:
            down(state_dir, console)
    steps = [StepTimes.of(record) for record in seen.records if record.published]
    summary = summarize(seen.rows, seen.versions_published, RewardStreamSettings().window_s, steps)
    commit, tree_dirty = report.provenance()
    result = LoopResult(
        # The summary's own fields, as they are (asdict would make dicts of its records).
        **vars(summary),
        intake=intake(seen.records),
        latest_version=seen.latest_version,
        minutes=round(duration_s / 60, 2),
        command=f"rtrl bench loop --minutes {duration_s / 60:g} --product {product}",
        commit=commit,
        tree_dirty=tree_dirty,
        load_avg_1_5_15_before=tuple(round(x, 2) for x in load_before),
        load_avg_1_5_15_after=tuple(round(x, 2) for x in load_after),
        cpus=os.cpu_count(),
        trainer=trainer_run(),
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
    if taken.token_staleness:
        console.print(
            f"tokens trained, by versions behind the candidate's base: {taken.token_staleness} "
            f"({taken.newest_token_share} sampled by the newest version)"
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
