"""The report's training figures: reward components by version, and the trainer's steps
(reward, KL, eval-gate scores and refusals, staleness, where each step's time went).

Read from the sink's ``rewards`` and ``trainer_steps`` tables (FINAL, so replays count
once); each figure is a PNG for analytics.report.write_html.
"""

from __future__ import annotations

import io
import math
from collections import Counter
from dataclasses import dataclass

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from rtrl import topics
from rtrl.analytics.query import QueryFn
from rtrl.analytics.schema import TRAINER_STEPS

COMPONENTS = (
    "persisted_fraction",
    "dissatisfied",
    "effort_penalty",
    "tool_call_validity",
    "reward",
)
PHASES = ("batch_wait_s", "step_s", "eval_s", "publish_s")


@dataclass(frozen=True)
class Figures:
    """(heading, description, PNG) per figure, in the order they are shown."""

    items: tuple[tuple[str, str, bytes], ...]


def reward_components(query_fn: QueryFn, max_buckets: int = 20) -> list[dict]:
    """Mean of each reward component per arm and policy-version bucket."""
    (span,) = query_fn(
        "SELECT min(policy_version) AS lo, max(policy_version) AS hi "
        f"FROM rewards FINAL WHERE topic = '{topics.REWARD}'"
    )
    size = max(1, math.ceil((int(span["hi"] or 0) - int(span["lo"] or 0) + 1) / max_buckets))
    means = ", ".join(f"avg({c}) AS {c}" for c in COMPONENTS)
    return query_fn(
        f"SELECT arm, intDiv(policy_version, {size}) * {size} AS version, count() AS rewards, {means} "
        f"FROM rewards FINAL WHERE topic = '{topics.REWARD}' GROUP BY arm, version ORDER BY arm, version"
    )


def trainer_steps(query_fn: QueryFn) -> list[dict]:
    return query_fn(
        "SELECT step, published, version, reward_mean, kl, entropy, clipped_fraction, grad_norm, staleness, "
        "eval_candidate, " + ", ".join(PHASES) + f" FROM {TRAINER_STEPS} FINAL ORDER BY step"
    )


# Produced by mismatch_summary; consumed by `rtrl report` (rtrl.ops.reporting).
@dataclass(frozen=True)
class MismatchSummary:
    """The train–inference mismatch over the whole run (trainer/mismatch.py)."""

    steps: int
    """Trainer steps recorded."""
    measured_steps: int
    """Of them, the steps that had tokens sampled by the weights they started from."""
    tokens: int
    mean: float
    """Token mean |Δ log p| over every measured token (nats)."""
    max: float
    over_threshold_share: float
    thresholds: tuple[float, ...]
    """The mismatch_threshold(s) the shares were counted against."""


def mismatch_summary(query_fn: QueryFn) -> MismatchSummary | None:
    """None when no step measured any token."""
    (row,) = query_fn(
        "SELECT count() AS steps, countIf(mismatch_tokens > 0) AS measured_steps, "
        "sum(mismatch_tokens) AS tokens, sum(mismatch_mean * mismatch_tokens) AS gap_sum, "
        "max(mismatch_max) AS gap_max, "
        "sum(mismatch_over_threshold_share * mismatch_tokens) AS over, "
        "groupUniqArray(if(mismatch_tokens > 0, mismatch_threshold, 0)) AS thresholds "
        f"FROM {TRAINER_STEPS} FINAL"
    )
    tokens = int(row["tokens"] or 0)
    if tokens == 0:
        return None
    return MismatchSummary(
        steps=int(row["steps"]),
        measured_steps=int(row["measured_steps"]),
        tokens=tokens,
        mean=float(row["gap_sum"]) / tokens,
        max=float(row["gap_max"]),
        over_threshold_share=float(row["over"]) / tokens,
        thresholds=tuple(sorted(float(t) for t in row["thresholds"] if t)),
    )


def figures(query_fn: QueryFn) -> Figures:
    from rtrl.analytics.agents_report import agents_by_version, agents_png

    items = []
    agents = agents_by_version(query_fn)
    if agents:
        items.append(
            (
                "Agents by policy version",
                "how the policy works per arm: tool calls, broken calls, parallel turns, turns, "
                "clarifying questions and the users' wait (trajectory_links, rollouts.wall_s)",
                agents_png(agents),
            )
        )
    components = reward_components(query_fn)
    if components:
        items.append(
            (
                "Reward components by policy version",
                "mean of each reward component per arm",
                _components_png(components),
            )
        )
    steps = trainer_steps(query_fn)
    if steps:
        items.append(
            (
                "Training steps",
                "reward, KL and eval-gate scores per step; refused candidates marked",
                _steps_png(steps),
            )
        )
        items.append(
            (
                "Staleness and loop latency",
                "rollout staleness at training time; time per step phase",
                _latency_png(steps),
            )
        )
    return Figures(tuple(items))


def _components_png(rows: list[dict]) -> bytes:
    figure = Figure(figsize=(12, 3.2), layout="constrained")
    for axes, component in zip(figure.subplots(1, len(COMPONENTS)), COMPONENTS, strict=True):
        for arm, color in (("control", "tab:blue"), ("treatment", "tab:orange")):
            points = [
                (int(r["version"]), float(r[component]))
                for r in rows
                if r["arm"] == arm and r[component] is not None
            ]
            if points:
                axes.plot(
                    *zip(*points, strict=True), marker="o", markersize=3, color=color, label=arm
                )
        axes.set_title(component.replace("_", " "))
        axes.set_xlabel("policy version")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    figure.axes[0].legend(loc="best")
    return _png(figure)


def _steps_png(steps: list[dict]) -> bytes:
    figure = Figure(figsize=(12, 3.2), layout="constrained")
    reward, kl, gate = figure.subplots(1, 3)
    x = [int(s["step"]) for s in steps]
    reward.plot(x, [s["reward_mean"] for s in steps], color="tab:orange")
    reward.set_title("batch reward mean")
    kl.plot(x, [s["kl"] for s in steps], color="tab:purple", label="KL (k1)")
    kl.plot(x, [s["entropy"] for s in steps], color="tab:gray", label="entropy")
    kl.set_title("KL to control, entropy")
    kl.legend(loc="best")
    for checker, color in (("well_formed", "tab:green"), ("house_style", "tab:orange")):
        gate.plot(x, [s["eval_candidate"].get(checker) for s in steps], color=color, label=checker)
    refused = [s for s in steps if not s["published"]]
    if refused:
        gate.scatter(
            [int(s["step"]) for s in refused],
            [s["eval_candidate"].get("well_formed") for s in refused],
            color="red",
            marker="x",
            zorder=3,
            label="refused",
        )
    gate.set_title("eval gate: candidate scores")
    gate.legend(loc="best")
    for axes in (reward, kl, gate):
        axes.set_xlabel("training step")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    return _png(figure)


def _latency_png(steps: list[dict]) -> bytes:
    figure = Figure(figsize=(12, 3.2), layout="constrained")
    staleness_axes, phase_axes = figure.subplots(1, 2)
    staleness: Counter[int] = Counter()
    for s in steps:
        staleness.update({int(k): int(v) for k, v in s["staleness"].items()})
    if staleness:
        ages = sorted(staleness)
        staleness_axes.bar(ages, [staleness[a] for a in ages], color="tab:blue")
    staleness_axes.set_title("rollouts by staleness when trained")
    staleness_axes.set_xlabel("versions behind the trainer")
    staleness_axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    x = [int(s["step"]) for s in steps]
    bottom = [0.0] * len(steps)
    for phase in PHASES:
        values = [float(s[phase]) for s in steps]
        phase_axes.bar(x, values, bottom=bottom, label=phase.removesuffix("_s").replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    phase_axes.set_title("seconds per step, by phase")
    phase_axes.set_xlabel("training step")
    phase_axes.legend(loc="best")
    return _png(figure)


def _png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=80)
    return buffer.getvalue()
