"""`rtrl status`: health, consumer lag per group and topic, versions per worker, the
reward trend per arm, and the reward-hacking alerts reward_stream keeps in its heartbeat.

``collect`` gathers it as one typed StackStatus (what `rtrl status --json` prints);
``render`` draws the same from the same heartbeats as tables.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Group
from rich.table import Table

from rtrl import kafka, topics
from rtrl.config import StackSettings
from rtrl.heartbeat import GateRefusal, InferenceBeat, RewardAlert, RewardStreamBeat, TrainerBeat
from rtrl.ops import broker_record, health
from rtrl.ops.stack import StackFile

# Consumer group -> the topics it reads.
CONSUMER_GROUPS = {
    "rtrl-reward-stream": topics.TELEMETRY,
    "trainer": (topics.REWARD,),
    "analytics": topics.ALL,
}

# Sparkline blocks, lowest first.
SPARKS = "▁▂▃▄▅▆▇█"
# Points in a reward trend's sparkline.
TREND_POINTS = 30
# Rollouts pooled into each point of a trend: the newest version always has only a few
# settled rewards, and the mean of three is noise, not trend.
TREND_MIN_ROLLOUTS = 20
# A fitted change over the window smaller than this reads as flat (1% of r1's range).
TREND_FLAT = 0.02


BeatT = TypeVar("BeatT", InferenceBeat, RewardStreamBeat, TrainerBeat)


# Produced by consumer_lag; consumed by the lag table and StackStatus.
@dataclass(frozen=True)
class TopicLag:
    group: str
    topic: str
    committed: int
    """Offsets the group committed, summed over the topic's partitions."""
    end: int
    lag: int


# Produced by collect; consumed by `rtrl status --json` and whoever scripts against it.
@dataclass(frozen=True)
class WorkerVersions:
    worker: str
    versions: Mapping[str, int]
    """The version each arm serves (-1: none yet)."""
    completions: int
    swaps: int


# Produced by collect; consumed by `rtrl status --json` (asdict) and tests.
@dataclass(frozen=True)
class StackStatus:
    healthy: bool
    """Every component is up and ready."""
    components: tuple[health.ComponentHealth, ...]
    lag: tuple[TopicLag, ...]
    workers: tuple[WorkerVersions, ...]
    trainers: Mapping[str, TrainerBeat]
    """The trainer's beat (step, published version, reward mean...) by component name."""
    trend: Mapping[str, tuple[TrendPoint, ...]]
    """Mean settled reward per arm over the newest policy versions, oldest first."""
    alerts: tuple[RewardAlert, ...]
    refusals: tuple[GateRefusal, ...]
    reward_fn_version: str
    previous_broker: str
    """What the previous run's memory-only broker took with it ("" if nothing is known)."""


def consumer_lag(stack: StackFile) -> list[TopicLag]:
    settings = StackSettings(kafka_bootstrap=stack.kafka_bootstrap)
    every_topic = tuple(sorted({t for names in CONSUMER_GROUPS.values() for t in names}))
    ends = kafka.end_offsets(settings, kafka.partitions(settings, every_topic))
    lags = []
    for group, names in CONSUMER_GROUPS.items():
        by_topic: dict[str, list[kafka.PartitionLag]] = {}
        for row in kafka.consumer_lag(settings, group, names, ends=ends):
            by_topic.setdefault(row.topic, []).append(row)
        for topic, parts in by_topic.items():
            committed = sum(max(p.committed, 0) for p in parts)
            lags.append(
                TopicLag(
                    group, topic, committed, sum(p.end for p in parts), sum(p.lag for p in parts)
                )
            )
    return lags


def lag_table(stack: StackFile) -> Table:
    table = Table(title="consumer lag", title_justify="left")
    for column in ("group", "topic", "committed", "end", "lag"):
        table.add_column(
            column, justify="right" if column in ("committed", "end", "lag") else "left"
        )
    for row in consumer_lag(stack):
        style = "green" if row.lag < 100 else "yellow" if row.lag < 1000 else "red"
        table.add_row(
            row.group, row.topic, str(row.committed), str(row.end), f"[{style}]{row.lag}[/]"
        )
    return table


def _beats(rows: Sequence[health.ComponentHealth], kind: type[BeatT]) -> list[tuple[str, BeatT]]:
    """(component name, beat) of every row whose beat is a ``kind``."""
    return [(row.name, row.beat) for row in rows if isinstance(row.beat, kind)]


def worker_versions(rows: Sequence[health.ComponentHealth]) -> list[WorkerVersions]:
    return [
        WorkerVersions(name, dict(beat.versions), beat.completions, beat.swaps)
        for name, beat in _beats(rows, InferenceBeat)
    ]


def workers_table(rows: Sequence[health.ComponentHealth]) -> Table:
    table = Table(title="policy versions", title_justify="left")
    for column in ("component", "control", "treatment", "detail"):
        table.add_column(column)
    for worker in worker_versions(rows):
        detail = f"{worker.completions} completions, {worker.swaps} swaps"
        table.add_row(
            worker.worker,
            str(worker.versions.get("control", "-")),
            str(worker.versions.get("treatment", "-")),
            detail,
        )
    for name, beat in _beats(rows, TrainerBeat):
        reward = "–" if beat.reward_mean is None else f"{beat.reward_mean:.3f}"
        shed = beat.dropped.get("shed", 0)
        detail = (
            f"step {beat.step}, reward mean {reward}, dropped stale {beat.dropped_stale}"
            + (f", shed {shed} (behind its traffic)" if shed else "")
            + f", eval gate refused {beat.refused}\n{mismatch_summary(beat)}"
        )
        table.add_row(name, "0 (pinned)", f"{beat.version} (published)", detail)
    return table


def mismatch_summary(beat: TrainerBeat) -> str:
    """The train–inference mismatch the trainer last measured, in one phrase."""
    gap = beat.mismatch
    if gap is None:
        return "train–inference mismatch not measured yet"
    share = gap.over_threshold_share
    style = "green" if share < 0.01 else "yellow" if share < 0.1 else "red"
    return (
        f"train–inference |Δ log p| mean {gap.mean:.2e} max {gap.max:.2e}, "
        f"[{style}]{100 * share:.1f} % over {gap.threshold:g}[/] "
        f"({gap.tokens} tokens at step {gap.step})"
    )


def gate_refusals(rows: Sequence[health.ComponentHealth]) -> list[GateRefusal]:
    """The eval gate's most recent refusals from every trainer heartbeat (trainer.loop.Trainer._refuse)."""
    return [refusal for _, beat in _beats(rows, TrainerBeat) for refusal in beat.refusals]


def refusals_table(refusals: Sequence[GateRefusal]) -> Table:
    table = Table(title="eval gate refusals (newest last)", title_justify="left")
    for column in ("step", "rollouts", "checker", "candidate", "published", "control", "why"):
        table.add_column(column, justify="left" if column in ("checker", "why") else "right")
    for refusal in refusals:
        for checker, score in refusal.candidate.items():
            failed = [r for r in refusal.regressions if r.startswith(f"{checker} ")]
            table.add_row(
                str(refusal.step),
                str(refusal.rollouts),
                checker,
                f"{score:.3f}",
                f"{refusal.published[checker]:.3f}",
                f"{refusal.control[checker]:.3f}",
                "[red]" + "; ".join(failed) + "[/]" if failed else "ok",
            )
    return table


def hacking_alerts(rows: Sequence[health.ComponentHealth]) -> list[RewardAlert]:
    """The alerts in every reward_stream heartbeat, oldest first."""
    return [alert for _, beat in _beats(rows, RewardStreamBeat) for alert in beat.alerts]


def _versions(first: int, last: int) -> str:
    return f"v{last}" if first in (-1, last) else f"v{first}-v{last}"


def alerts_table(alerts: Sequence[RewardAlert], examples: int = 2) -> Table:
    table = Table(title="reward-hacking alerts (newest last)", title_justify="left")
    for column in (
        "kind",
        "metric",
        "from",
        "to",
        "rate / mean",
        "z",
        "rollouts",
        "e.g. rollout ids",
    ):
        table.add_column(column, justify="right" if column in ("z", "rollouts") else "left")
    for a in alerts:
        table.add_row(
            a.kind,
            a.metric,
            _versions(a.previous_first_version, a.previous_version),
            _versions(a.first_version, a.version),
            f"{a.previous_value:.3f} -> {a.value:.3f}",
            f"{a.z_score:+.1f}",
            f"{a.previous_samples} / {a.samples}",
            ", ".join(a.examples[:examples]),
        )
    return table


def sparkline(values: Sequence[float]) -> str:
    """One block per value, from ▁ for the smallest to █ for the largest; equal values sit mid-height."""
    if not values:
        return ""
    low, high = min(values), max(values)
    if high == low:
        return SPARKS[3] * len(values)
    return "".join(
        SPARKS[min(len(SPARKS) - 1, int((v - low) / (high - low) * len(SPARKS)))] for v in values
    )


def fitted_change(values: Sequence[float]) -> float:
    """Change from the first to the last point along the least-squares line through values:
    one noisy end point does not swing it the way last minus first would."""
    k = len(values)
    if k < 2:
        return 0.0
    mid, mean = (k - 1) / 2, sum(values) / k
    slope = sum((x - mid) * (y - mean) for x, y in enumerate(values)) / sum(
        (x - mid) ** 2 for x in range(k)
    )
    return slope * (k - 1)


@dataclass(frozen=True)
class TrendPoint:
    """The settled rewards of consecutive policy versions."""

    first_version: int
    last_version: int
    rollouts: int
    reward_mean: float


def reward_totals(rows: Sequence[health.ComponentHealth]) -> dict[int, tuple[int, float]]:
    """Policy version -> (rollouts, sum of their rewards) over every reward_stream heartbeat
    (reward_stream.monitors.reward_by_version); each worker counts the partitions it read."""
    totals: dict[int, tuple[int, float]] = {}
    for _, beat in _beats(rows, RewardStreamBeat):
        for entry in beat.reward_by_version:
            n, total = totals.get(entry.version, (0, 0.0))
            totals[entry.version] = (n + entry.rollouts, total + entry.rollouts * entry.reward_mean)
    return totals


def pool(
    totals: dict[int, tuple[int, float]], min_rollouts: int = TREND_MIN_ROLLOUTS
) -> list[TrendPoint]:
    """Consecutive versions pooled from the newest back until each point holds min_rollouts,
    oldest first. The oldest versions left over join the oldest point, or are the only one."""
    groups: list[list[int]] = []
    taken: list[int] = []
    for version in sorted(totals, reverse=True):
        taken.append(version)
        if sum(totals[v][0] for v in taken) >= min_rollouts:
            groups.append(taken)
            taken = []
    if taken and groups:
        groups[-1].extend(taken)
    elif taken:
        groups.append(taken)
    points = []
    for group in reversed(groups):
        n = sum(totals[v][0] for v in group)
        points.append(TrendPoint(min(group), max(group), n, sum(totals[v][1] for v in group) / n))
    return points


def control_versions(rows: Sequence[health.ComponentHealth]) -> set[int]:
    """The versions inference workers serve the control arm; v0 until one reports, since the
    trainer pins control to the initial policy (trainer.loop.Trainer.start)."""
    served = {beat.versions.get("control", -1) for _, beat in _beats(rows, InferenceBeat)}
    return {v for v in served if v >= 0} or {0}


def arm_trends(rows: Sequence[health.ComponentHealth]) -> dict[str, list[TrendPoint]]:
    """Each arm's reward trend. Control's version also holds treatment's rollouts of it (the
    initial policy, before the first publish): the same weights."""
    totals = reward_totals(rows)
    control = control_versions(rows)
    return {
        "control": pool({v: t for v, t in totals.items() if v in control}),
        "treatment": pool({v: t for v, t in totals.items() if v not in control}),
    }


def _change(points: list[TrendPoint]) -> str:
    if len(points) < 2:
        return "–"
    change = fitted_change([p.reward_mean for p in points])
    if change >= TREND_FLAT:
        return f"[green]rising {change:+.3f}[/]"
    if change <= -TREND_FLAT:
        return f"[red]falling {change:+.3f}[/]"
    return f"flat {change:+.3f}"


def trend_table(rows: Sequence[health.ComponentHealth]) -> Table | str:
    """Mean settled reward per arm over the newest policy versions."""
    arms = arm_trends(rows)
    if not any(arms.values()):
        return "reward trend: no rewards yet"
    control_n = sum(p.rollouts for p in arms["control"])
    control_mean = (
        sum(p.rollouts * p.reward_mean for p in arms["control"]) / control_n if control_n else None
    )
    table = Table(
        title=f"reward trend (mean reward, a point per {TREND_MIN_ROLLOUTS}+ rollouts of consecutive versions)",
        title_justify="left",
    )
    for column in (
        "arm",
        "latest",
        "change",
        f"last {TREND_POINTS} points",
        "versions",
        "rollouts",
        "vs control",
    ):
        table.add_column(
            column, justify="right" if column in ("latest", "rollouts", "vs control") else "left"
        )
    for arm, points in arms.items():
        window = points[-TREND_POINTS:]
        if not window:
            table.add_row(arm, "–", "–", "no rewards yet", "", "0", "")
            continue
        latest = window[-1].reward_mean
        versus = "" if arm == "control" or control_mean is None else f"{latest - control_mean:+.3f}"
        table.add_row(
            arm,
            f"{latest:.3f}",
            _change(window),
            sparkline([p.reward_mean for p in window]),
            _versions(window[0].first_version, window[-1].last_version),
            str(sum(p.rollouts for p in window)),
            versus,
        )
    return table


def collect(stack: StackFile) -> StackStatus:
    """Everything `rtrl status` shows, typed."""
    rows = health.check(stack)
    return StackStatus(
        healthy=all(row.healthy for row in rows),
        components=tuple(rows),
        lag=tuple(consumer_lag(stack)),
        workers=tuple(worker_versions(rows)),
        trainers=dict(_beats(rows, TrainerBeat)),
        trend={arm: tuple(points[-TREND_POINTS:]) for arm, points in arm_trends(rows).items()},
        alerts=tuple(hacking_alerts(rows)),
        refusals=tuple(gate_refusals(rows)),
        reward_fn_version=stack.reward_fn_version,
        previous_broker=broker_loss(broker_record.read(Path(stack.state_dir)).previous),
    )


def as_json(status: StackStatus) -> dict[str, Any]:
    """The status as a JSON object: StackStatus's fields, nested dataclasses as objects
    (a component's beat holds the fields of its service's beat in rtrl.heartbeat)."""
    return dataclasses.asdict(status)


def render(stack: StackFile) -> Group:
    from rtrl.ops.lifecycle import health_table

    rows = health.check(stack)
    parts = [health_table(rows), workers_table(rows), trend_table(rows), lag_table(stack)]
    alerts = hacking_alerts(rows)
    if stack.reward_fn_version:
        parts.append(
            f"reward function: {stack.reward_fn_version}; reward-hacking alerts: {len(alerts) or 'none'}"
        )
    if alerts:
        parts.append(alerts_table(alerts))
    refusals = gate_refusals(rows)
    if refusals:
        parts.append(refusals_table(refusals))
    lost = broker_loss(broker_record.read(Path(stack.state_dir)).previous)
    if lost:
        parts.append(lost)
    return Group(*parts)


def broker_loss(previous: broker_record.BrokerRecord | None) -> str:
    """What the previous run's memory-only broker took with it, in one sentence."""
    if previous is None:
        return ""
    if previous.measured_ts is None:
        return f"previous broker {previous.cluster_id}: gone with its topics; what it held was never measured"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(previous.measured_ts))
    reading = " after every service stopped" if previous.final else ", its last reading"
    bound = "" if previous.final else "about "
    return (
        f"previous broker {previous.cluster_id} (read {when}{reading}): "
        f"{bound}{previous.unjoined_events} accepted events and "
        f"{previous.unjoined_rollouts} rollouts were still unjoined "
        f"and {previous.untrained_rewards} rewards untrained when it went away; they are lost with it"
    )
