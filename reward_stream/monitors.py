"""Reward-hacking guards: behaviour rates per policy version, alerts on sharp shifts
and on slow drift.

A policy that finds a cheap way to score shows it first as a change in behaviour,
not in reward: it stops proposing edits, asks instead of answering, or breaks tool
calls to avoid a worse penalty. The monitor feeds on reward records as they settle,
groups them by the policy version that produced the rollout, and makes two
comparisons:

  * step: each version against the previous one (the largest lower version with
    enough samples), every rate and mean. Catches a sharp shift.
  * drift: the newest versions pooled until they hold drift_window rollouts,
    against a reference window: at first the oldest versions pooled the same way
    (the warm start), after an alert the window that raised it. Catches a hack
    that grows a little with every version: the trainer publishes every second or
    two with tens of rollouts each, so no two adjacent versions differ by much.

Pure logic like the join: ``step(state, record) -> (state, alerts)`` updates the
per-version tallies inside ``state`` in place (the state passed in is consumed) and
returns the alerts that record triggered.

Behaviour rates, one boolean per rollout:
  * edit: the completion contains code (signals.has_code: a ``` fence or a line
    indented by a tab or 2+ spaces) or a persistence snapshot was joined. A proxy:
    the reward record does not say whether an edit_shown event was joined.
  * clarifying_question: the completion, stripped, ends with "?" and contains no
    code.
  * broken_tool_call: at least one tool call has valid == false.
  * dissatisfied: the dissatisfied component is >= 0.5.
Means of the reward components (persisted_fraction, tool_call_validity,
effort_penalty) and of the reward are compared as well. Latency is not: it is a
property of the moment a rollout was served (batch size, load) more than of the
policy, and a version's rollouts are all served within the same second or two, so
they are not independent samples: on the live stack adjacent versions differ in
mean latency at z 4-10 every few versions, alerts that would crowd the real ones
out of the heartbeat.

Step alert rule: both versions hold >= min_samples rollouts, |z| >= z_threshold and the
absolute shift >= min_shift. Rates use the pooled two-proportion z-score, means
Welch's z. With the defaults (50 samples, z 4, shift 0.1) one comparison of a
stable policy crosses z 4 by chance about once in 16,000; the rule is re-checked on
every record, so over a version's life the false-alarm rate is higher (repeated
looks), which is why z is 4 and not 2 or 3. A 10-point jump in a rate near 0.5
needs about 800 samples per version to reach z 4; a 40-point jump (what a hack
looks like) about 50. Each (version, metric) alerts at most once, the first time
the rule holds, so the alert's rates are those at that moment.

Drift alert rule, only for the behaviours in DRIFT and only in the direction given
there (more questions, more broken tool calls, fewer edits): z >= z_threshold in
that direction and a shift >= drift_min_shift. The other metrics are left out on
purpose: a policy that learns moves persisted_fraction and reward up and
dissatisfied down, slowly, all run long; a drift test on them would alert on
every healthy run and bury the alerts that matter (the heartbeat keeps only the
newest few). The behaviours in DRIFT are not what the users reward, so a policy
that drifts towards them is being paid for something else. With the defaults (400
rollouts per window, z 4, shift 0.05) a stable rate near 0.1 needs a 4-sigma
excursion of a whole window to alert: about once in 30,000 windows, and windows
only renew every 400 rollouts. After an alert the reference moves to the window
that raised it, so one drift alerts once and a further drift of the same size
alerts again.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from rtrl.heartbeat import RewardAlert as Alert
from rtrl.heartbeat import RewardByVersion
from rtrl.reward_stream.signals import has_code
from rtrl.trajectory_summary import Summary
from rtrl.v1 import reward_pb2, rollout_pb2

RATES = ("edit", "clarifying_question", "broken_tool_call", "dissatisfied")
# Behaviours watched for drift, with the direction a hack moves them (+1 up, -1 down).
DRIFT = {"clarifying_question": 1, "broken_tool_call": 1, "edit": -1}
MEANS = ("persisted_fraction", "tool_call_validity", "effort_penalty", "reward")
ALERT_KEYS: tuple[tuple[str, str], ...] = (
    *((metric, "step") for metric in RATES),
    *((f"mean_{metric}", "step") for metric in MEANS),
    *((metric, "drift") for metric in DRIFT),
)
"""Every (metric, kind) an alert can carry: the joiner exports a count for each from the
start, at 0, so a rule's increase() sees the first alert (a series born at 1 has none)."""
# Newest versions whose mean reward the heartbeat carries (the reward trend in rtrl status).
REWARD_VERSIONS_SHOWN = 60


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
    drift_window: int = 400
    """Rollouts pooled over consecutive versions on each side of a drift comparison."""
    drift_min_shift: float = 0.05
    """Smallest drift of a DRIFT behaviour's rate worth an alert, however significant."""

    def __post_init__(self) -> None:
        if self.min_samples < 2 or self.drift_window < 2:
            raise ValueError(
                f"min_samples and drift_window must be >= 2, got {self.min_samples}, {self.drift_window}"
            )
        if self.drift_min_shift < 0:
            raise ValueError(f"drift_min_shift must be >= 0, got {self.drift_min_shift}")
        if self.z_threshold <= 0 or self.min_shift < 0 or self.max_examples < 0:
            raise ValueError("z_threshold must be > 0, min_shift and max_examples >= 0")


@dataclass
class VersionTally:
    """Running counts of one policy version (mutable: updated in place by step)."""

    n: int = 0
    hits: Counter[str] = field(default_factory=Counter)
    sums: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    squares: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
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
    ordered: list[int] = field(default_factory=list)
    """Every version seen, ascending."""
    drift_reference: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """DRIFT metric -> the versions its drift is measured against."""


def policy_version(rollout: rollout_pb2.RolloutRecord) -> int | None:
    """The version that sampled most of the rollout's tokens (the later one on a tie)."""
    return Summary.of(rollout).majority_version()


def is_clarifying_question(completion_text: str) -> bool:
    return completion_text.strip().endswith("?") and not has_code(completion_text)


def behaviours(
    record: reward_pb2.RewardRecord, rollout: rollout_pb2.RolloutRecord
) -> dict[str, bool]:
    c, summary = record.components, Summary.of(rollout)
    return {
        "edit": c.persistence_observed or has_code(summary.final_text),
        "clarifying_question": is_clarifying_question(summary.final_text),
        "broken_tool_call": summary.invalid_tool_calls > 0,
        "dissatisfied": c.dissatisfied >= 0.5,
    }


AGENT_COUNTS = (
    "trajectories",
    "turns",
    "tool_calls",
    "broken_calls",
    "parallel_turns",
    "clarifying_questions",
    "edits",
    "truncations",
)
"""What rtrl.reward.behaviour counts per arm (agent_counts): over "trajectories", each a
rate or a mean per rollout."""


def agent_counts(
    record: reward_pb2.RewardRecord, rollout: rollout_pb2.RolloutRecord
) -> dict[str, int]:
    """One settled rollout's share of AGENT_COUNTS (a single-turn completion is a trajectory
    of one turn)."""
    summary = Summary.of(rollout)
    flags = behaviours(record, rollout)
    return {
        "trajectories": 1,
        "turns": summary.turns,
        "tool_calls": summary.tool_call_count,
        "broken_calls": summary.invalid_tool_calls,
        "parallel_turns": summary.parallel_turns,
        "clarifying_questions": int(flags["clarifying_question"]),
        "edits": int(flags["edit"]),
        "truncations": int(summary.finish_reason == "length"),
    }


def values(record: reward_pb2.RewardRecord) -> dict[str, float]:
    c = record.components
    return {
        **{name: getattr(c, name) for name in MEANS if name != "reward"},
        "reward": record.reward,
    }


def step(
    state: MonitorState,
    record: reward_pb2.RewardRecord,
    rollout: rollout_pb2.RolloutRecord | None = None,
) -> tuple[MonitorState, list[Alert]]:
    """Count one reward record; returns the alerts it triggered (consumes ``state``).

    ``rollout`` is the record's rollout when the record does not carry it (the joiner
    builds rewards without the rollout and splices its bytes in, see reward.py)."""
    if rollout is None:
        rollout = record.rollout
    version = policy_version(rollout)
    if version is None:
        state.unversioned["records"] += 1
        return state, []
    if version not in state.versions:
        state.versions[version] = VersionTally()
        bisect.insort(state.ordered, version)
    tally = state.versions[version]
    _count(tally, record, rollout, state.config.max_examples)
    alerts = _drift_alerts(state)
    previous = _previous(state, version)
    if previous is None or tally.n < state.config.min_samples:
        return state, alerts
    steps = [
        alert
        for alert in (
            *_rate_alerts(state, previous, version),
            *_mean_alerts(state, previous, version),
        )
        if (version, alert.metric) not in state.alerted
    ]
    state.alerted.update((version, alert.metric) for alert in steps)
    return state, alerts + steps


def _count(
    tally: VersionTally,
    record: reward_pb2.RewardRecord,
    rollout: rollout_pb2.RolloutRecord,
    max_examples: int,
) -> None:
    tally.n += 1
    for metric, flag in behaviours(record, rollout).items():
        tally.hits[metric] += flag
        ids = tally.examples.setdefault((metric, flag), [])
        if len(ids) < max_examples:
            ids.append(record.rollout_id)
    for metric, value in values(record).items():
        tally.sums[metric] += value
        tally.squares[metric] += value * value
        for high in (True, False):
            # Keep the max_examples largest (high) or smallest values, as (value, id) pairs.
            kept = sorted(
                [*tally.extremes.get((metric, high), []), (value, record.rollout_id)], reverse=high
            )
            tally.extremes[(metric, high)] = kept[:max_examples]


def reward_by_version(
    state: MonitorState, newest: int = REWARD_VERSIONS_SHOWN
) -> tuple[RewardByVersion, ...]:
    """Rollouts and mean reward of the newest ``newest`` versions and of the oldest (the
    warm start, which the control arm serves), oldest first. Produced for the heartbeat;
    consumed by rtrl.ops.status_view's reward trend, which adds up the workers' counts."""
    shown = sorted({*state.ordered[:1], *state.ordered[-newest:]})
    return tuple(
        RewardByVersion(
            v, state.versions[v].n, state.versions[v].sums["reward"] / state.versions[v].n
        )
        for v in shown
    )


def _previous(state: MonitorState, version: int) -> int | None:
    for lower in reversed(state.ordered[: bisect.bisect_left(state.ordered, version)]):
        if state.versions[lower].n >= state.config.min_samples:
            return lower
    return None


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
            alerts.append(_step_alert(state, metric, previous, version, p0, p1, z, examples))
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
            examples = tuple(
                rollout_id for _, rollout_id in after.extremes.get((metric, m1 > m0), [])
            )
            alerts.append(
                _step_alert(state, f"mean_{metric}", previous, version, m0, m1, z, examples)
            )
    return alerts


def _step_alert(
    state: MonitorState,
    metric: str,
    previous: int,
    version: int,
    before: float,
    after: float,
    z: float,
    examples: tuple[str, ...],
) -> Alert:
    n0, n1 = state.versions[previous].n, state.versions[version].n
    return Alert(
        metric,
        previous,
        version,
        before,
        after,
        z,
        examples,
        kind="step",
        previous_first_version=previous,
        first_version=version,
        previous_samples=n0,
        samples=n1,
    )


def _drift_alerts(state: MonitorState) -> list[Alert]:
    config = state.config
    if not state.drift_reference:
        reference = _window(state, state.ordered)
        if reference is None:
            return []
        state.drift_reference.update(dict.fromkeys(DRIFT, reference))
    pools: dict[tuple[int, ...], tuple[tuple[int, ...], Counter, Counter] | None] = {}
    alerts = []
    for metric, direction in DRIFT.items():
        reference = state.drift_reference[metric]
        if reference not in pools:
            current = _window(
                state, reversed(state.ordered[bisect.bisect_right(state.ordered, reference[-1]) :])
            )
            pools[reference] = (
                None
                if current is None
                else (current, _pooled(state, reference), _pooled(state, current))
            )
        pool = pools[reference]
        if pool is None:
            continue
        current, before, after = pool
        n0, n1, k0, k1 = before["n"], after["n"], before[metric], after[metric]
        p0, p1 = k0 / n0, k1 / n1
        pooled = (k0 + k1) / (n0 + n1)
        se = math.sqrt(pooled * (1 - pooled) * (1 / n0 + 1 / n1))
        z = (p1 - p0) / se if se > 0 else 0.0
        if direction * z >= config.z_threshold and direction * (p1 - p0) >= config.drift_min_shift:
            examples = [
                i
                for v in reversed(current)
                for i in state.versions[v].examples.get((metric, direction > 0), [])
            ]
            alerts.append(
                Alert(
                    metric,
                    reference[-1],
                    current[-1],
                    p0,
                    p1,
                    z,
                    tuple(examples[: config.max_examples]),
                    kind="drift",
                    previous_first_version=reference[0],
                    first_version=current[0],
                    previous_samples=n0,
                    samples=n1,
                )
            )
            state.drift_reference[metric] = current
    return alerts


def _window(state: MonitorState, versions) -> tuple[int, ...] | None:
    """The first of ``versions`` (in the order given) holding drift_window rollouts
    together, ascending; None if all of them hold fewer."""
    taken, n = [], 0
    for version in versions:
        taken.append(version)
        n += state.versions[version].n
        if n >= state.config.drift_window:
            return tuple(sorted(taken))
    return None


def _pooled(state: MonitorState, versions: tuple[int, ...]) -> Counter:
    """Rollouts ("n") and rollouts showing each DRIFT behaviour over ``versions``."""
    total: Counter = Counter()
    for version in versions:
        tally = state.versions[version]
        total["n"] += tally.n
        for metric in DRIFT:
            total[metric] += tally.hits[metric]
    return total


def _mean_var(tally: VersionTally, metric: str) -> tuple[float, float]:
    mean = tally.sums[metric] / tally.n
    # Sample variance from running sums; clamped because rounding can make it slightly negative.
    var = max(0.0, (tally.squares[metric] - tally.n * mean * mean) / (tally.n - 1))
    return mean, var
