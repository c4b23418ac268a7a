"""The A/B report: control (frozen policy) vs treatment (live RL), read from the sink's tables.

Definitions (rewards on ``rl.reward.v1`` only; each reward_id and rollout_id counts once:
the A/B table reads the tables with FINAL, the per-version table the A/B views, which
keep one value per id):
  persisted_rate     share of rewards whose edit was observed persisting in full:
                     ``persistence_observed AND persisted_fraction >= 0.999``. A rollout whose
                     window closed without a persistence snapshot counts as not persisted.
  dissatisfied_rate  share of rewards with ``dissatisfied > 0`` (a follow-up classified as dissatisfied).
  reward_mean        mean scalar reward.
  latency_p50_s      exact median of what the users waited (rollouts.wall_s: a completion's
                     serving latency; an agent's trajectory from its first request to its
                     last answer, tool time included).
  policy version     the highest version among a rollout's spans (it may span a swap).
  relative_change    (treatment - control) / control; None for counts or a zero control.
``last_half`` keeps rollouts whose event time is in the later half of the run's span
(the span of rollout timestamps over both tables), when treatment has had time to learn.
"""

from __future__ import annotations

import base64
import html
import io
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from rtrl import topics
from rtrl.analytics import schema
from rtrl.analytics.query import QueryFn
from rtrl.analytics.schema import PERSISTED_THRESHOLD

ARMS = ("control", "treatment")
COUNT_METRICS = ("rollouts", "rewards")
RATE_METRICS = ("persisted_rate", "dissatisfied_rate", "reward_mean", "latency_p50_s")
LATENCY_QUANTILES = {"latency_p50_s": 0.5, "latency_p90_s": 0.9, "latency_p99_s": 0.99}

_REWARDS = f"rewards FINAL WHERE topic = '{topics.REWARD}'"
_REWARD_AGGREGATES = f"""count() AS rewards,
    countIf(persistence_observed AND persisted_fraction >= {PERSISTED_THRESHOLD}) / count() AS persisted_rate,
    countIf(dissatisfied > 0) / count() AS dissatisfied_rate,
    avg(reward) AS reward_mean"""


@dataclass(frozen=True)
class ArmMetrics:
    arm: str
    rollouts: int
    rewards: int
    persisted_rate: float | None
    dissatisfied_rate: float | None
    reward_mean: float | None
    latency_p50_s: float | None


@dataclass(frozen=True)
class ABRow:
    """One metric of one time window, both arms side by side."""

    window: str  # "all" or "last_half"
    metric: str
    control: float | None
    treatment: float | None
    relative_change: float | None


@dataclass(frozen=True)
class VersionRow:
    """Reward metrics of one arm for the policy versions [policy_version, policy_version + bucket_size)."""

    arm: str
    policy_version: int
    bucket_size: int
    rewards: int
    persisted_rate: float | None
    dissatisfied_rate: float | None
    reward_mean: float | None
    latency_p50_s: float | None


@dataclass(frozen=True)
class HourRow:
    """A/B metrics of one arm, policy version and hour of the rollouts' event time: rates and
    means over its rewards (analytics.schema.REWARD_VALUES), the rest over its rollouts."""

    arm: str
    policy_version: int
    hour: datetime
    rollouts: int
    rewards: int
    persisted_rate: float | None
    dissatisfied_rate: float | None
    followup_rate: float | None
    defaulted_rate: float | None
    reward_mean: float | None
    persisted_fraction: float | None
    dissatisfied: float | None
    tool_call_validity: float | None
    effort_penalty: float | None
    clarifying_question_rate: float | None
    latency_p50_s: float | None
    latency_p90_s: float | None
    latency_p99_s: float | None


def arm_metrics(query_fn: QueryFn, since_ms: int | None = None) -> dict[str, ArmMetrics]:
    """Per arm, over rollouts with event time >= since_ms (all when None)."""
    reward_filter = (
        f" AND toUnixTimestamp64Milli(rollout_ts) >= {int(since_ms)}"
        if since_ms is not None
        else ""
    )
    rollout_filter = (
        f" WHERE toUnixTimestamp64Milli(ts) >= {int(since_ms)}" if since_ms is not None else ""
    )
    rewards = {
        r["arm"]: r
        for r in query_fn(
            f"SELECT arm, {_REWARD_AGGREGATES} FROM {_REWARDS}{reward_filter} GROUP BY arm"
        )
    }
    rollouts = {
        r["arm"]: r
        for r in query_fn(
            "SELECT arm, count() AS rollouts, "
            "quantileExactInclusive(0.5)(wall_s) AS latency_p50_s "
            f"FROM rollouts FINAL{rollout_filter} GROUP BY arm"
        )
    }
    metrics = {}
    for arm in sorted(set(rewards) | set(rollouts)):
        r, o = rewards.get(arm, {}), rollouts.get(arm, {})
        metrics[arm] = ArmMetrics(
            arm=arm,
            rollouts=int(o.get("rollouts", 0)),
            rewards=int(r.get("rewards", 0)),
            persisted_rate=_number(r.get("persisted_rate")),
            dissatisfied_rate=_number(r.get("dissatisfied_rate")),
            reward_mean=_number(r.get("reward_mean")),
            latency_p50_s=_number(o.get("latency_p50_s")),
        )
    return metrics


def run_span_ms(query_fn: QueryFn) -> tuple[int, int] | None:
    """(first, last) rollout event time in ms, or None before any data."""
    (row,) = query_fn(
        "SELECT min(t) AS first, max(t) AS last, count() AS n FROM ("
        "SELECT toUnixTimestamp64Milli(ts) AS t FROM rollouts UNION ALL "
        f"SELECT toUnixTimestamp64Milli(rollout_ts) AS t FROM rewards WHERE topic = '{topics.REWARD}')"
    )
    return (int(row["first"]), int(row["last"])) if int(row["n"]) else None


def ab_table(query_fn: QueryFn) -> list[ABRow]:
    span = run_span_ms(query_fn)
    windows: dict[str, int | None] = {"all": None}
    if span is not None:
        windows["last_half"] = (span[0] + span[1]) // 2
    rows = []
    for window, since_ms in windows.items():
        metrics = arm_metrics(query_fn, since_ms)
        for metric in COUNT_METRICS + RATE_METRICS:
            control = getattr(metrics["control"], metric) if "control" in metrics else None
            treatment = getattr(metrics["treatment"], metric) if "treatment" in metrics else None
            change = None
            if metric in RATE_METRICS and control and treatment is not None:
                change = (treatment - control) / control
            rows.append(ABRow(window, metric, control, treatment, change))
    return rows


AB_JSON_METRICS = {
    "edits_persisted": ("persisted_rate", 1.0),
    "dissatisfied_followups": ("dissatisfied_rate", 1.0),
    "latency_p50_ms": ("latency_p50_s", 1000.0),
    "rollouts": ("rollouts", 1.0),
}
"""reports/ab.json's names for the A/B metrics: (ab_table's metric, scale)."""


def ab_json(rows: list[ABRow]) -> dict[str, dict[str, dict[str, float | None]]]:
    """The A/B tables as ``{"whole_run": {"control": {"edits_persisted": ...,
    "dissatisfied_followups": ..., "latency_p50_ms": ..., "rollouts": ...}, "treatment":
    {...}}, "second_half": {...}}``; a metric an arm has no data for is null."""
    values = {(r.window, r.metric): (r.control, r.treatment) for r in rows}
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for window, name in (("all", "whole_run"), ("last_half", "second_half")):
        if not any(w == window for w, _ in values):
            continue
        out[name] = {}
        for index, arm in enumerate(("control", "treatment")):
            arm_values: dict[str, float | None] = {}
            for key, (metric, scale) in AB_JSON_METRICS.items():
                value = values.get((window, metric), (None, None))[index]
                if value is not None:
                    value = int(value) if metric == "rollouts" else value * scale
                arm_values[key] = value
            out[name][arm] = arm_values
    return out


def by_version(
    query_fn: QueryFn, bucket_size: int | None = None, max_buckets: int = 20
) -> list[VersionRow]:
    """Reward metrics per arm and policy-version bucket, from the A/B views; the latency is
    that of the bucket's rollouts. Without a bucket_size, buckets are sized so treatment gets
    at most ``max_buckets`` of them."""
    if bucket_size is None:
        (row,) = query_fn(
            f"SELECT max(policy_version) AS hi, min(policy_version) AS lo FROM {schema.AB_REWARDS}"
        )
        spread = int(row["hi"] or 0) - int(row["lo"] or 0) + 1
        bucket_size = max(1, math.ceil(spread / max_buckets))
    b = int(bucket_size)
    keys = {"arm": "arm", "version": f"intDiv(policy_version, {b}) * {b}"}
    rewards = _from_view(query_fn, schema.AB_REWARDS, schema.REWARD_VALUES, keys)
    rollouts = _from_view(query_fn, schema.AB_ROLLOUTS, schema.ROLLOUT_VALUES, keys)
    return [
        VersionRow(
            arm=arm,
            policy_version=int(version),
            bucket_size=b,
            rewards=int(r["ids"]),
            persisted_rate=_number(r["persisted_rate"]),
            dissatisfied_rate=_number(r["dissatisfied_rate"]),
            reward_mean=_number(r["reward_mean"]),
            latency_p50_s=_number(rollouts.get((arm, version), {}).get("latency_p50_s")),
        )
        for (arm, version), r in sorted(rewards.items())
    ]


def by_hour(query_fn: QueryFn) -> list[HourRow]:
    """The A/B metrics per arm, policy version and hour, from the A/B views."""
    keys = {"arm": "arm", "version": "policy_version", "hour_s": "toUnixTimestamp(hour)"}
    rewards = _from_view(query_fn, schema.AB_REWARDS, schema.REWARD_VALUES, keys)
    rollouts = _from_view(query_fn, schema.AB_ROLLOUTS, schema.ROLLOUT_VALUES, keys)
    rows = []
    for arm, version, hour_s in sorted(set(rewards) | set(rollouts)):
        r, o = rewards.get((arm, version, hour_s), {}), rollouts.get((arm, version, hour_s), {})
        rows.append(
            HourRow(
                arm=arm,
                policy_version=int(version),
                hour=datetime.fromtimestamp(int(hour_s), UTC),
                rollouts=int(o.get("ids", 0)),
                rewards=int(r.get("ids", 0)),
                **{name: _number(r.get(name)) for name in schema.REWARD_VALUES},
                clarifying_question_rate=_number(o.get("clarifying_question_rate")),
                **{name: _number(o.get(name)) for name in LATENCY_QUANTILES},
            )
        )
    return rows


def _from_view(
    query_fn: QueryFn, view: str, values: dict[str, str], keys: dict[str, str]
) -> dict[tuple, dict]:
    """Per group of ``keys`` (alias -> expression over the view's key columns): ``ids``, the
    number of distinct ids, and each of ``values`` as its mean (latency_s as quantiles).
    The groups' id -> values maps are merged first, so an id in several parts counts once."""
    metrics = ["length(tupleElement(m, 1)) AS ids"]
    for index, name in enumerate(values, start=2):
        array = f"tupleElement(m, {index})"
        if name == "latency_s":
            metrics += [
                f"arrayReduce('quantileExactInclusive({q})', {array}) AS {metric}"
                for metric, q in LATENCY_QUANTILES.items()
            ]
        else:
            metrics.append(f"arrayAvg({array}) AS {name}")
    groups = ", ".join(f"{expression} AS {alias}" for alias, expression in keys.items())
    rows = query_fn(
        f"SELECT {', '.join(keys)}, {', '.join(metrics)} FROM "
        f"(SELECT {groups}, maxMapMerge(by_id) AS m FROM {view} GROUP BY {', '.join(keys)})"
    )
    return {tuple(row[alias] for alias in keys): row for row in rows}


_STYLE = (
    "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin-bottom:2em}\n"
    "td,th{border:1px solid #ccc;padding:4px 10px;text-align:right}"
    "td:first-child,td:nth-child(2){text-align:left}"
)
_VERSION_HEADER = (
    "<tr><th>arm</th><th>policy version</th><th>rewards</th><th>persisted</th>"
    "<th>dissatisfied</th><th>reward mean</th><th>latency p50</th></tr>"
)


def write_html(
    path: Path | str,
    ab_rows: list[ABRow],
    version_rows: list[VersionRow],
    *,
    title: str = "rtrl A/B report",
    extra_figures: tuple[tuple[str, str, bytes], ...] = (),
) -> Path:
    """A self-contained HTML page: the A/B table, the per-version table and the plots
    (``extra_figures``: (heading, description, PNG), e.g. analytics.training_report)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    png = base64.b64encode(_plot_png(ab_rows, version_rows)).decode()
    ab_body = "".join(
        f"<tr><td>{r.window}</td><td>{r.metric}</td><td>{_fmt(r.metric, r.control)}</td>"
        f"<td>{_fmt(r.metric, r.treatment)}</td><td>{_change(r.relative_change)}</td></tr>"
        for r in ab_rows
    )
    version_body = "".join(
        f"<tr><td>{html.escape(v.arm)}</td><td>{v.policy_version}"
        + (f"–{v.policy_version + v.bucket_size - 1}" if v.bucket_size > 1 else "")
        + f"</td><td>{v.rewards}</td><td>{_fmt('persisted_rate', v.persisted_rate)}</td>"
        f"<td>{_fmt('dissatisfied_rate', v.dissatisfied_rate)}</td><td>{_fmt('reward_mean', v.reward_mean)}</td>"
        f"<td>{_fmt('latency_p50_s', v.latency_p50_s)}</td></tr>"
        for v in version_rows
    )
    definitions = html.escape(__doc__.split("\n", 2)[2].strip())
    extra = "".join(
        f'<h2>{html.escape(heading)}</h2>\n<img alt="{html.escape(description)}" '
        f'src="data:image/png;base64,{base64.b64encode(png).decode()}">\n'
        for heading, description, png in extra_figures
    )
    path.write_text(
        f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{_STYLE}</style>
</head><body>
<h1>{html.escape(title)}</h1>
<h2>Treatment vs control</h2>
<table><tr><th>window</th><th>metric</th><th>control</th><th>treatment</th><th>change</th></tr>{ab_body}</table>
<h2>By policy version</h2>
<img alt="persisted and dissatisfied rate by policy version" src="data:image/png;base64,{png}">
<table>{_VERSION_HEADER}{version_body}</table>
{extra}
<h2>Definitions</h2><pre>{definitions}</pre>
</body></html>
""",
        encoding="utf-8",
    )
    return path


def render(query_fn: QueryFn, path: Path | str, bucket_size: int | None = None) -> Path:
    from rtrl.analytics.training_report import figures

    return write_html(
        path,
        ab_table(query_fn),
        by_version(query_fn, bucket_size),
        extra_figures=figures(query_fn).items,
    )


def _plot_png(ab_rows: list[ABRow], version_rows: list[VersionRow]) -> bytes:
    figure = Figure(figsize=(10, 4), layout="constrained")
    overall = {r.metric: r for r in ab_rows if r.window == "all"}
    treatment = [v for v in version_rows if v.arm == "treatment"]
    for axes, metric, label in zip(
        figure.subplots(1, 2),
        ("persisted_rate", "dissatisfied_rate"),
        ("edits persisted", "dissatisfied follow-ups"),
        strict=True,
    ):
        points = [
            (v.policy_version, getattr(v, metric))
            for v in treatment
            if getattr(v, metric) is not None
        ]
        if points:
            axes.plot(*zip(*points, strict=True), marker="o", color="tab:orange", label="treatment")
        control = overall[metric].control if metric in overall else None
        if control is not None:
            # Control serves one pinned version, so it is a level, not a curve.
            axes.axhline(control, color="tab:blue", linestyle="--", label="control")
        axes.set_title(label)
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.set_xlabel("policy version")
        axes.set_ylabel("share of rewards")
        axes.legend(loc="best")
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=90)
    return buffer.getvalue()


def _number(value: Any) -> float | None:
    if value is None:
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _fmt(metric: str, value: float | None) -> str:
    if value is None:
        return "–"
    if metric in COUNT_METRICS:
        return f"{int(value)}"
    if metric.endswith("_rate"):
        return f"{100 * value:.2f} %"
    if metric == "latency_p50_s":
        return f"{value * 1000:.1f} ms"
    return f"{value:.4f}"


def _change(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:+.2f} %"
