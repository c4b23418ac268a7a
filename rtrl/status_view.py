"""`rtrl status`: health, consumer lag per group and topic, versions per worker, and
the reward-hacking alerts reward_stream keeps in its heartbeat."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table

from rtrl import health, kafka, topics
from rtrl.config import StackSettings
from rtrl.stack import StackFile

# Consumer group -> the topics it reads.
CONSUMER_GROUPS = {
    "rtrl-reward-stream": topics.TELEMETRY,
    "trainer": (topics.REWARD,),
    "analytics": topics.ALL,
}


def lag_table(stack: StackFile) -> Table:
    settings = StackSettings(kafka_bootstrap=stack.kafka_bootstrap)
    table = Table(title="consumer lag", title_justify="left")
    for column in ("group", "topic", "committed", "end", "lag"):
        table.add_column(column, justify="right" if column in ("committed", "end", "lag") else "left")
    every_topic = tuple(sorted({t for names in CONSUMER_GROUPS.values() for t in names}))
    ends = kafka.end_offsets(settings, kafka.partitions(settings, every_topic))
    for group, names in CONSUMER_GROUPS.items():
        rows = kafka.consumer_lag(settings, group, names, ends=ends)
        by_topic: dict[str, list[kafka.PartitionLag]] = {}
        for row in rows:
            by_topic.setdefault(row.topic, []).append(row)
        for topic, parts in by_topic.items():
            committed = sum(max(p.committed, 0) for p in parts)
            end = sum(p.end for p in parts)
            lag = sum(p.lag for p in parts)
            style = "green" if lag < 100 else "yellow" if lag < 1000 else "red"
            table.add_row(group, topic, str(committed), str(end), f"[{style}]{lag}[/]")
    return table


def workers_table(rows: list[health.ComponentHealth]) -> Table:
    table = Table(title="policy versions", title_justify="left")
    for column in ("component", "control", "treatment", "detail"):
        table.add_column(column)
    for row in rows:
        if row.name.startswith("inference:"):
            versions = row.status.get("versions", {})
            detail = f"{row.status.get('completions', 0)} completions, {row.status.get('swaps', 0)} swaps"
            table.add_row(row.name, str(versions.get("control", "-")), str(versions.get("treatment", "-")), detail)
        elif row.name.startswith("trainer:"):
            s = row.status
            reward_mean = s.get("reward_mean")
            reward = "–" if reward_mean is None else f"{reward_mean:.3f}"
            detail = f"step {s.get('step', 0)}, reward mean {reward}, dropped stale {s.get('dropped_stale', 0)}, eval gate refused {s.get('refused', 0)}"
            table.add_row(row.name, "0 (pinned)", f"{s.get('version', '-')} (published)", detail)
    return table


def gate_refusals(rows: list[health.ComponentHealth]) -> list[dict]:
    """The eval gate's most recent refusals from every trainer heartbeat (trainer.loop.Trainer._refuse)."""
    return [refusal for row in rows if row.name.startswith("trainer:") for refusal in row.status.get("refusals", [])]


def refusals_table(refusals: list[dict]) -> Table:
    table = Table(title="eval gate refusals (newest last)", title_justify="left")
    for column in ("step", "rollouts", "checker", "candidate", "published", "control", "why"):
        table.add_column(column, justify="left" if column in ("checker", "why") else "right")
    for refusal in refusals:
        for checker, score in refusal["candidate"].items():
            failed = [r for r in refusal["regressions"] if r.startswith(f"{checker} ")]
            table.add_row(
                str(refusal["step"]),
                str(refusal.get("rollouts", "")),
                checker,
                f"{score:.3f}",
                f"{refusal['published'][checker]:.3f}",
                f"{refusal['control'][checker]:.3f}",
                "[red]" + "; ".join(failed) + "[/]" if failed else "ok",
            )
    return table


def hacking_alerts(rows: list[health.ComponentHealth]) -> list[dict]:
    """The alerts in every reward_stream heartbeat (reward_stream.monitors.Alert as dicts), oldest first."""
    return [alert for row in rows if row.name.startswith("reward_stream:") for alert in row.status.get("alerts", [])]


def _versions(first: int, last: int) -> str:
    return f"v{last}" if first in (-1, last) else f"v{first}-v{last}"


def alerts_table(alerts: list[dict], examples: int = 2) -> Table:
    table = Table(title="reward-hacking alerts (newest last)", title_justify="left")
    for column in ("kind", "metric", "from", "to", "rate / mean", "z", "rollouts", "e.g. rollout ids"):
        table.add_column(column, justify="right" if column in ("z", "rollouts") else "left")
    for a in alerts:
        table.add_row(
            a.get("kind", "step"),
            a["metric"],
            _versions(a.get("previous_first_version", -1), a["previous_version"]),
            _versions(a.get("first_version", -1), a["version"]),
            f"{a['previous_value']:.3f} -> {a['value']:.3f}",
            f"{a['z_score']:+.1f}",
            f"{a.get('previous_samples', 0)} / {a.get('samples', 0)}",
            ", ".join(a["examples"][:examples]),
        )
    return table


def render(stack: StackFile) -> Group:
    from rtrl.lifecycle import health_table

    rows = health.check(stack)
    parts = [health_table(rows), workers_table(rows), lag_table(stack)]
    alerts = hacking_alerts(rows)
    if stack.reward_fn_version:
        parts.append(f"reward function: {stack.reward_fn_version}; reward-hacking alerts: {len(alerts) or 'none'}")
    if alerts:
        parts.append(alerts_table(alerts))
    refusals = gate_refusals(rows)
    if refusals:
        parts.append(refusals_table(refusals))
    return Group(*parts)
