"""Reward-hacking guards: behaviour rates per policy version, alerts on sharp shifts.

A policy that finds a cheap way to score shows it first as a change in behaviour,
not in reward: it stops proposing edits, asks instead of answering, or breaks tool
calls to avoid a worse penalty. The monitor feeds on reward records as they settle,
groups them by the policy version that produced the rollout, and compares each
version with the previous one (the largest lower version with enough samples).

Pure logic like the join: ``step(state, record) -> (state, alerts)`` updates the
per-version tallies inside ``state`` in place (the state passed in is consumed) and
returns the alerts that record triggered.

Behaviour rates, one boolean per rollout:
  * edit: the completion contains code (a ``` fence or a line indented by a tab
    or 4+ spaces) or a persistence snapshot was joined. A proxy: the reward record
    does not say whether an edit_shown event was joined.
  * clarifying_question: the completion, stripped, ends with "?" and contains no
    code (no ``` fence and no line indented by a tab or 4+ spaces).
  * broken_tool_call: at least one tool call has valid == false.
  * dissatisfied: the dissatisfied component is >= 0.5.
Means of the reward components (persisted_fraction, tool_call_validity,
effort_penalty, latency_s) and of the reward are compared as well.

Alert rule: both versions hold >= min_samples rollouts, |z| >= z_threshold and the
absolute shift >= min_shift. Rates use the pooled two-proportion z-score, means
Welch's z. With the defaults (50 samples, z 4, shift 0.1) one comparison of a
stable policy crosses z 4 by chance about once in 16,000; the rule is re-checked on
every record, so over a version's life the false-alarm rate is higher (repeated
looks), which is why z is 4 and not 2 or 3. A 10-point jump in a rate near 0.5
needs about 800 samples per version to reach z 4; a 40-point jump (what a hack
looks like) about 50. Each (version, metric) alerts at most once, the first time
the rule holds, so the alert's rates are those at that moment.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field

from rtrl.v1 import reward_pb2

RATES = ("edit", "clarifying_question", "broken_tool_call", "dissatisfied")
MEANS = ("persisted_fraction", "tool_call_validity", "effort_penalty", "latency_s", "reward")

_INDENTED_LINE = re.compile(r"^(\t| {4})\S", re.MULTILINE)


@dataclass(frozen=True)
class MonitorConfig:
    min_samples: int = 50
    """Rollouts each of the two versions needs before they are compared."""
    z_threshold: float = 4.0
    """|z| at or above which a shift is called significant."""
    min_shift: float = 0.1
    """Smallest absolute change in a rate or mean worth an alert, however significant."""
    max_examples: int = 5
    """Rollout ids kept per version and behaviour to show in an alert."""

    def __post_init__(self) -> None:
        if self.min_samples < 2:
            raise ValueError(f"min_samples must be >= 2, got {self.min_samples}")
        if self.z_threshold <= 0 or self.min_shift < 0 or self.max_examples < 0:
            raise ValueError("z_threshold must be > 0, min_shift and max_examples >= 0")


@dataclass(frozen=True)
class Alert:
    """A sharp shift in one behaviour between consecutive policy versions.

    Produced by step; consumed by whoever watches the loop (logs, the heartbeat, a
    gate that holds the next publish)."""

    metric: str
    previous_version: int
    version: int
    previous_value: float
    """The previous version's rate (or mean)."""
    value: float
    """This version's rate (or mean)."""
    z_score: float
    examples: tuple[str, ...]
    """Up to max_examples rollout ids of this version showing the shift."""


@dataclass
class VersionTally:
    """Running counts of one policy version (mutable: updated in place by step)."""

    n: int = 0
    hits: Counter = field(default_factory=Counter)
    sums: Counter = field(default_factory=Counter)
    squares: Counter = field(default_factory=Counter)
    examples: dict[tuple[str, bool], list[str]] = field(default_factory=dict)
    """(rate metric, flag) -> the first rollout ids with that flag."""
    extremes: dict[tuple[str, bool], list[tuple[float, str]]] = field(default_factory=dict)
    """(mean metric, high?) -> the most extreme (value, rollout id) pairs."""


@dataclass(frozen=True)
class MonitorState:
    config: MonitorConfig = field(default_factory=MonitorConfig)
    versions: dict[int, VersionTally] = field(default_factory=dict)
    alerted: set[tuple[int, str]] = field(default_factory=set)
    unversioned: Counter = field(default_factory=Counter)
    """Records skipped because their rollout has no version spans (key "records")."""


def policy_version(record: reward_pb2.RewardRecord) -> int | None:
    """The version that sampled most of the rollout's tokens (the later one on a tie)."""
    spans = record.rollout.version_spans
    if not spans:
        return None
    tokens: Counter = Counter()
    for span in spans:
        tokens[span.policy_version] += span.end - span.start
    return max(tokens, key=lambda v: (tokens[v], v))


def has_code(completion_text: str) -> bool:
    return "```" in completion_text or _INDENTED_LINE.search(completion_text) is not None


def is_clarifying_question(completion_text: str) -> bool:
    return completion_text.strip().endswith("?") and not has_code(completion_text)


def behaviours(record: reward_pb2.RewardRecord) -> dict[str, bool]:
    c = record.components
    return {
        "edit": c.persistence_observed or has_code(record.rollout.completion_text),
        "clarifying_question": is_clarifying_question(record.rollout.completion_text),
        "broken_tool_call": any(not call.valid for call in record.rollout.tool_calls),
        "dissatisfied": c.dissatisfied >= 0.5,
    }


def values(record: reward_pb2.RewardRecord) -> dict[str, float]:
    c = record.components
    return {**{name: getattr(c, name) for name in MEANS if name != "reward"}, "reward": record.reward}


def step(state: MonitorState, record: reward_pb2.RewardRecord) -> tuple[MonitorState, list[Alert]]:
    """Count one reward record; returns the alerts it triggered (consumes ``state``)."""
    version = policy_version(record)
    if version is None:
        state.unversioned["records"] += 1
        return state, []
    tally = state.versions.setdefault(version, VersionTally())
    _count(tally, record, state.config.max_examples)
    previous = _previous(state, version)
    if previous is None or tally.n < state.config.min_samples:
        return state, []
    alerts = [
        alert
        for alert in (*_rate_alerts(state, previous, version), *_mean_alerts(state, previous, version))
        if (version, alert.metric) not in state.alerted
    ]
    state.alerted.update((version, alert.metric) for alert in alerts)
    return state, alerts


def _count(tally: VersionTally, record: reward_pb2.RewardRecord, max_examples: int) -> None:
    tally.n += 1
    for metric, flag in behaviours(record).items():
        tally.hits[metric] += flag
        ids = tally.examples.setdefault((metric, flag), [])
        if len(ids) < max_examples:
            ids.append(record.rollout_id)
    for metric, value in values(record).items():
        tally.sums[metric] += value
        tally.squares[metric] += value * value
        for high in (True, False):
            # Keep the max_examples largest (high) or smallest values, as (value, id) pairs.
            kept = sorted([*tally.extremes.get((metric, high), []), (value, record.rollout_id)], reverse=high)
            tally.extremes[(metric, high)] = kept[:max_examples]


def _previous(state: MonitorState, version: int) -> int | None:
    lower = [v for v, t in state.versions.items() if v < version and t.n >= state.config.min_samples]
    return max(lower) if lower else None


def _rate_alerts(state: MonitorState, previous: int, version: int) -> list[Alert]:
    config, before, after = state.config, state.versions[previous], state.versions[version]
    alerts = []
    for metric in RATES:
        p0, p1 = before.hits[metric] / before.n, after.hits[metric] / after.n
        pooled = (before.hits[metric] + after.hits[metric]) / (before.n + after.n)
        se = math.sqrt(pooled * (1 - pooled) * (1 / before.n + 1 / after.n))
        z = (p1 - p0) / se if se > 0 else 0.0
        if abs(z) >= config.z_threshold and abs(p1 - p0) >= config.min_shift:
            examples = tuple(after.examples.get((metric, p1 > p0), []))
            alerts.append(Alert(metric, previous, version, p0, p1, z, examples))
    return alerts


def _mean_alerts(state: MonitorState, previous: int, version: int) -> list[Alert]:
    config, before, after = state.config, state.versions[previous], state.versions[version]
    alerts = []
    for metric in MEANS:
        m0, v0 = _mean_var(before, metric)
        m1, v1 = _mean_var(after, metric)
        se = math.sqrt(v0 / before.n + v1 / after.n)
        # Two constant samples that differ are as significant as it gets.
        z = (m1 - m0) / se if se > 0 else (math.copysign(math.inf, m1 - m0) if m1 != m0 else 0.0)
        if abs(z) >= config.z_threshold and abs(m1 - m0) >= config.min_shift:
            examples = tuple(rollout_id for _, rollout_id in after.extremes.get((metric, m1 > m0), []))
            alerts.append(Alert(f"mean_{metric}", previous, version, m0, m1, z, examples))
    return alerts


def _mean_var(tally: VersionTally, metric: str) -> tuple[float, float]:
    mean = tally.sums[metric] / tally.n
    # Sample variance from running sums; clamped because rounding can make it slightly negative.
    var = max(0.0, (tally.squares[metric] - tally.n * mean * mean) / (tally.n - 1))
    return mean, var
