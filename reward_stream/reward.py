"""Reward functions: from a rollout and the user signals joined to it, one scalar.

The final reward is a versioned function of the components in RewardComponents;
``FUNCTIONS`` maps each version string to its components and scalar, and every
RewardRecord names the version that produced it; RTRL_REWARD_REWARD_FN_VERSION picks
the live one and replay (reward_stream/replay.py) recomputes history with any. r3
(below r2's description) is the default (REWARD_FN_VERSION), the service's and the
embedded stack's (ops/stack.py, StackConfig.reward_fn_version). r1 is kept because
it is hackable by not editing: `rtrl demo --reward-fn r1` shows the monitor
(reward_stream/monitors.py) catching that.

Reward function r1:

    reward = persisted_fraction
             - 0.5 * dissatisfied
             - 0.5 * (1 - tool_call_validity)
             - effort_penalty

* persisted_fraction: fraction of the shown edit's non-empty lines still present in
  the newest persistence snapshot (signals.persisted_fraction). The edit text is
  the newest EditShown.edit_text, or the rollout's completion_text when no
  edit_shown arrived. With no snapshot: 0.0 if the user rejected the edit right
  away (it cannot have persisted), otherwise PERSISTENCE_DEFAULT = 0.5. The
  neutral 0.5 sits mid-range so an unobserved rollout is pushed neither up nor
  down against observed ones with a leave-one-out baseline; persistence_observed
  tells the trainer which case it got.
* dissatisfied: 1.0 if any follow-up reads as annoyed (signals.is_dissatisfied),
  0.0 when there was none or all were neutral.
* tool_call_validity: fraction of valid tool calls, 1.0 when there were none.
* effort_penalty: 0.0005 per completion token, at most 0.05 — small, so it only
  breaks ties between otherwise equal completions in favour of the shorter one.

Reward function r2:

    reward = persisted_r2
             - 0.5 * dissatisfied
             - 1.25 * (1 - tool_call_validity)
             - effort_penalty_r2
             - latency_penalty(latency_s)

* persisted_r2: the newest snapshot's persisted fraction p (as r1), trusted according
  to how long after the edit it was taken: c(age) = 1 - exp(-age / 60 s), and
  persisted_r2 = c * p + (1 - c) * PERSISTENCE_DEFAULT. A snapshot taken seconds
  after the edit mostly says the user has not got round to rewriting it yet
  (c(5 s) = 0.08), one taken minutes later is nearly the whole story
  (c(60 s) = 0.63, c(180 s) = 0.95). The age is the snapshot's seconds_after_edit,
  or, when unset, its event time minus the newest edit_shown's. Without a
  snapshot the r1 rules apply (rejected: 0.0, otherwise 0.5).
* dissatisfied: the highest P(dissatisfied) over the follow-ups from
  signals.dissatisfaction (the trained classifier, or the r1 rules as 1.0/0.0 when
  it cannot load), 0.0 without follow-ups. r1 keeps the rules so that a version
  string always names the same function.
* tool_call_validity: as r1. The invalid-call weight 1.25 exceeds
  PERSISTENCE_DEFAULT + DISSATISFIED_WEIGHT (1.0), so a rollout whose calls all
  broke (at best 0.5 - 1.25 = -0.75) always scores below the worst outcome of an
  honest edit (rejected and complained about: -0.5): breaking a tool call can
  never be a way to dodge a risky edit, which r1 (0.5 - 0.5 = 0.0) allowed.
* effort_penalty_r2 = min(0.5, 0.2 * excess**2) with
  excess = max(0, tokens / 512 - 1) + max(0, tool_calls / 8 - 1): nothing within
  the budget, quadratic above it. Nonlinear on purpose: a linear per-token cost
  rewards cutting every answer short, including the ones that needed the length,
  while the hinge leaves normal answers alone and the square makes runaway ones
  (loops, repeated tool calls) dominate any gain they could buy. The cap keeps the
  reward bounded. Tokens are the completion tokens (the RolloutRecord carries no
  separate thinking-token count or turn count yet).
* latency_penalty = min(0.25, 0.05 * max(0, latency_s - 2)): small and hinged
  because latency depends on serving load as much as on the policy; only the
  policy's share above a 2 s budget (long generations) is worth pushing on.

Reward function r3: r1, except that a rollout that made no edit
scores persisted_fraction 0.0 instead of the neutral default.

    reward = r1's scalar over r3's components

* made no edit: no edit_shown and no persistence snapshot was joined, and the
  completion contains no code (signals.has_code), e.g. a clarifying question, a
  refusal, a plan in prose. There is nothing to persist, so nothing persisted.
* Why: r1's neutral 0.5 is meant for an edit whose fate was not observed; paid to a
  rollout that never edited, it is a floor every risky edit has to beat. An edit
  that violates a user's style scores 0.5 - 0.5 * 0.7 = 0.15 on average under r1,
  so a policy can earn more by asking "which indent does p2 use?" (0.5) than by
  trying: that is Cursor's "clarifying questions to avoid risky edits". Under r3
  the question scores 0.0 (minus effort), below any edit that keeps a line.
* An edit whose telemetry was lost still has code in its completion, so it keeps
  r1's neutral 0.5 and is pushed neither up nor down, as in r1.

Reward functions a1 (the agentic product's default) and a1h (hackable):

    reward = persisted_fraction (as r3: nothing persists without an edit)
             - 0.5 * dissatisfied
             - 1.25 * (1 - tool_call_validity)
             - effort_penalty_a1

* effort_penalty_a1: reward_stream/effort.py, a square over generated tokens, tool calls,
  turns and tool I/O (A1_EFFORT; a configured curve is a version of its own: with_curve).
* A broken tool call is a negative example: its weight is r2's, so breaking a call never
  beats an honest edit.
* a1h scores the same, but a rollout with a broken call is ``discarded``: kept from training
  instead of scored, as Cursor's first agent reward did. A policy then learns to break a
  call where an honest attempt would be scored badly (the monitors' broken-call alert).

Reward functions a2 (the agentic demo's default) and a2h: a1 and a1h, except that a
complaint weighs as much as a kept edit earns.

    reward = a1's scalar over a1's components - 0.5 * dissatisfied   (so 1.0 * dissatisfied)

* Why: under a1 a wrong edit that keeps half its lines and draws a complaint scores
  0.5 - 0.5 = 0.0, no worse than asking (0.0), so where an edit is a guess (p4 without a
  written style: right a quarter of the time) guessing beats asking by the right guesses'
  share, and a policy that learns it raises dissatisfaction to raise persistence. The demo
  measured exactly that: treatment's p4 complaints went 0.38 -> 0.71 under a1 while p0-p3's
  fell. Under a2 the same wrong edit scores -0.5 and the guess about -0.13 against the
  question's 0.0: the reward no longer pays for trading one of the product's measured
  directions for another.

So r2 lies in [-2.5, 1.0], r1, r3 in [-1.05, 1.0], a1, a1h in [-2.25, 1.0] and a2, a2h in
[-2.75, 1.0]. A reward is
``defaulted`` when no user signal (persistence snapshot, follow-up or edit outcome) was
joined, i.e. it rests only on the defaults above.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rtrl.reward_stream.effort import A1_EFFORT, EffortCurve
from rtrl.reward_stream.reward_wire import reward_id
from rtrl.reward_stream.signals import (
    dissatisfaction,
    has_code,
    is_dissatisfied,
    persisted_fraction,
)
from rtrl.trajectory_summary import Summary
from rtrl.v1 import reward_pb2, rollout_pb2
from rtrl_client.v1 import telemetry_pb2

REWARD_FN_VERSION = "r3"
AGENT_REWARD_FN_VERSION = "a2"
"""The agentic product's default (ops/demo.py)."""
_REJECTED = telemetry_pb2.EditOutcome.OUTCOME_REJECTED
PERSISTENCE_DEFAULT = 0.5
DISSATISFIED_WEIGHT = 0.5
DISSATISFIED_WEIGHT_A2 = 1.0
INVALID_TOOL_WEIGHT = 0.5
EFFORT_PER_TOKEN = 0.0005
EFFORT_CAP = 0.05

PERSISTENCE_TRUST_TAU_S = 60.0
INVALID_TOOL_WEIGHT_R2 = 1.25
TOKEN_BUDGET = 512
TOOL_CALL_BUDGET = 8
EFFORT_WEIGHT_R2 = 0.2
EFFORT_CAP_R2 = 0.5
LATENCY_BUDGET_S = 2.0
LATENCY_WEIGHT = 0.05
LATENCY_CAP = 0.25


def _newest(
    events: Sequence[telemetry_pb2.TelemetryEvent], payload: str
) -> telemetry_pb2.TelemetryEvent | None:
    matching = [e for e in events if e.WhichOneof("payload") == payload]
    # max keeps the first of equal timestamps; reversed makes it the last to arrive.
    return max(reversed(matching), key=lambda e: e.client_ts_ms) if matching else None


def components(
    rollout: rollout_pb2.RolloutRecord, telemetry: Sequence[telemetry_pb2.TelemetryEvent]
) -> reward_pb2.RewardComponents:
    """The r1 components (see the module docstring)."""
    summary = Summary.of(rollout)
    shown = _newest(telemetry, "edit_shown")
    snapshot = _newest(telemetry, "persistence")
    if snapshot is not None:
        persisted = _snapshot_fraction(summary, shown, snapshot)
    else:
        persisted = _unobserved_persistence(telemetry)
    followups = _followups(telemetry)
    return _user_components(
        rollout,
        summary,
        followups,
        persisted_fraction=persisted,
        persistence_observed=snapshot is not None,
        dissatisfied=1.0 if any(is_dissatisfied(m) for m in followups) else 0.0,
        effort_penalty=min(EFFORT_CAP, EFFORT_PER_TOKEN * summary.generated_tokens),
    )


def _scalar(c: reward_pb2.RewardComponents, invalid_tool_weight: float) -> float:
    """Persisted, less dissatisfaction, broken calls at ``invalid_tool_weight``, and effort."""
    return (
        c.persisted_fraction
        - DISSATISFIED_WEIGHT * c.dissatisfied
        - invalid_tool_weight * (1.0 - c.tool_call_validity)
        - c.effort_penalty
    )


def reward(c: reward_pb2.RewardComponents) -> float:
    """The r1 scalar (see the module docstring); in [-1.05, 1.0]."""
    return _scalar(c, INVALID_TOOL_WEIGHT)


def made_no_edit(
    rollout: rollout_pb2.RolloutRecord, telemetry: Sequence[telemetry_pb2.TelemetryEvent]
) -> bool:
    """No edit was shown or snapshotted and the completion holds no code (r3)."""
    kinds = {e.WhichOneof("payload") for e in telemetry}
    return not kinds & {"edit_shown", "persistence"} and not has_code(
        Summary.of(rollout).final_text
    )


def components_r3(
    rollout: rollout_pb2.RolloutRecord, telemetry: Sequence[telemetry_pb2.TelemetryEvent]
) -> reward_pb2.RewardComponents:
    """The r3 components: r1's, with nothing persisted when no edit was made."""
    parts = components(rollout, telemetry)
    if made_no_edit(rollout, telemetry):
        parts.persisted_fraction = 0.0
    return parts


def persistence_trust(age_s: float) -> float:
    """How far a snapshot taken ``age_s`` after the edit is trusted over the neutral default."""
    return 1.0 - math.exp(-max(0.0, age_s) / PERSISTENCE_TRUST_TAU_S)


def effort_penalty_r2(completion_tokens: int, tool_calls: int) -> float:
    excess = max(0.0, completion_tokens / TOKEN_BUDGET - 1.0) + max(
        0.0, tool_calls / TOOL_CALL_BUDGET - 1.0
    )
    return min(EFFORT_CAP_R2, EFFORT_WEIGHT_R2 * excess**2)


def latency_penalty(latency_s: float) -> float:
    return min(LATENCY_CAP, LATENCY_WEIGHT * max(0.0, latency_s - LATENCY_BUDGET_S))


def components_r2(
    rollout: rollout_pb2.RolloutRecord, telemetry: Sequence[telemetry_pb2.TelemetryEvent]
) -> reward_pb2.RewardComponents:
    """The r2 components; persisted_fraction holds the age-weighted value the scalar uses."""
    summary = Summary.of(rollout)
    shown = _newest(telemetry, "edit_shown")
    snapshot = _newest(telemetry, "persistence")
    if snapshot is not None:
        age_s = snapshot.persistence.seconds_after_edit
        if age_s <= 0 and shown is not None:
            age_s = (snapshot.client_ts_ms - shown.client_ts_ms) / 1000
        trust = persistence_trust(age_s)
        persisted = (
            trust * _snapshot_fraction(summary, shown, snapshot)
            + (1.0 - trust) * PERSISTENCE_DEFAULT
        )
    else:
        persisted = _unobserved_persistence(telemetry)
    followups = _followups(telemetry)
    return _user_components(
        rollout,
        summary,
        followups,
        persisted_fraction=persisted,
        persistence_observed=snapshot is not None,
        dissatisfied=max(dissatisfaction(followups)) if followups else 0.0,
        effort_penalty=effort_penalty_r2(summary.generated_tokens, summary.tool_call_count),
    )


def reward_r2(c: reward_pb2.RewardComponents) -> float:
    """The r2 scalar (see the module docstring); in [-2.5, 1.0]."""
    return _scalar(c, INVALID_TOOL_WEIGHT_R2) - latency_penalty(c.latency_s)


def _snapshot_fraction(
    summary: Summary,
    shown: telemetry_pb2.TelemetryEvent | None,
    snapshot: telemetry_pb2.TelemetryEvent,
) -> float:
    agent_text = shown.edit_shown.edit_text if shown is not None else summary.final_text
    return persisted_fraction(agent_text, snapshot.persistence.region_text)


def _unobserved_persistence(telemetry: Sequence[telemetry_pb2.TelemetryEvent]) -> float:
    outcome = _newest(telemetry, "edit_outcome")
    rejected = outcome is not None and outcome.edit_outcome.outcome == _REJECTED
    return 0.0 if rejected else PERSISTENCE_DEFAULT


def _followups(telemetry: Sequence[telemetry_pb2.TelemetryEvent]) -> list[str]:
    return [e.followup.message for e in telemetry if e.WhichOneof("payload") == "followup"]


def _user_components(
    rollout: rollout_pb2.RolloutRecord,
    summary: Summary,
    followups: list[str],
    *,
    persisted_fraction: float,
    persistence_observed: bool,
    dissatisfied: float,
    effort_penalty: float,
) -> reward_pb2.RewardComponents:
    """The components every version computes the same way, plus the ones each version
    computes its own way (the keyword arguments)."""
    calls = summary.tool_call_count
    return reward_pb2.RewardComponents(
        followup_observed=bool(followups),
        tool_call_validity=1.0 - summary.invalid_tool_calls / calls if calls else 1.0,
        latency_s=rollout.wall_s or rollout.latency_s,
        persisted_fraction=persisted_fraction,
        persistence_observed=persistence_observed,
        dissatisfied=dissatisfied,
        effort_penalty=effort_penalty,
    )


def components_a1(
    curve: EffortCurve,
) -> Callable[
    [rollout_pb2.RolloutRecord, Sequence[telemetry_pb2.TelemetryEvent]],
    reward_pb2.RewardComponents,
]:
    """The a1 components over ``curve``: r3's, with the curve's effort penalty."""

    def parts(
        rollout: rollout_pb2.RolloutRecord, telemetry: Sequence[telemetry_pb2.TelemetryEvent]
    ) -> reward_pb2.RewardComponents:
        out = components_r3(rollout, telemetry)
        out.effort_penalty = curve.penalty(Summary.of(rollout))
        return out

    return parts


def reward_a1(c: reward_pb2.RewardComponents) -> float:
    """The a1 scalar (see the module docstring); in [-2.25, 1.0]."""
    return _scalar(c, INVALID_TOOL_WEIGHT_R2)


def reward_a2(c: reward_pb2.RewardComponents) -> float:
    """The a2 scalar: a1's, with a complaint weighed as a whole kept edit; in [-2.75, 1.0]."""
    return reward_a1(c) - (DISSATISFIED_WEIGHT_A2 - DISSATISFIED_WEIGHT) * c.dissatisfied


def broken_call(c: reward_pb2.RewardComponents) -> bool:
    """A rollout a1h discards: it made a broken tool call."""
    return c.tool_call_validity < 1.0


@dataclass(frozen=True)
class RewardFunction:
    """One version of the reward: how components are computed and folded into the scalar."""

    version: str
    components: Callable[
        [rollout_pb2.RolloutRecord, Sequence[telemetry_pb2.TelemetryEvent]],
        reward_pb2.RewardComponents,
    ]
    scalar: Callable[[reward_pb2.RewardComponents], float]
    discards: Callable[[reward_pb2.RewardComponents], bool] | None = None
    """Which rollouts it keeps from training instead of scoring (None: none)."""


AGENTIC_SCALARS: dict[str, Callable[[reward_pb2.RewardComponents], float]] = {
    "a1": reward_a1,
    "a2": reward_a2,
}
"""The agentic families by name: each one's version, its hackable twin (name + h) and its
versions over a configured effort curve (name@digest, name + h@digest)."""


def _agentic(version: str, curve: EffortCurve) -> tuple[RewardFunction, RewardFunction]:
    """An agentic family's function and its hackable twin over ``curve``, named ``version``
    (``a1``, ``a2``, or either @digest) and the same with h after the family's name."""
    family = version.split("@", 1)[0]
    scalar, parts = AGENTIC_SCALARS[family], components_a1(curve)
    return (
        RewardFunction(version, parts, scalar),
        RewardFunction(version.replace(family, family + "h", 1), parts, scalar, broken_call),
    )


FUNCTIONS = {
    f.version: f
    for f in (
        RewardFunction("r1", components, reward),
        RewardFunction("r2", components_r2, reward_r2),
        RewardFunction("r3", components_r3, reward),
        *_agentic("a1", A1_EFFORT),
        *_agentic("a2", A1_EFFORT),
    )
}


_CONFIGURED: dict[str, RewardFunction] = {}
"""Versions over a configured effort curve (with_curve), beside the built-in FUNCTIONS."""


def with_curve(version: str, curve: EffortCurve | None) -> str:
    """The version that settles as ``version`` over ``curve``: itself for a function without a
    curve or with the default one, else ``<version>@<curve digest>`` (a1@…, a1h@…, a2@…,
    a2h@…), known from now on to function_of."""
    family = version.removesuffix("h")
    if curve is None or curve == A1_EFFORT or family not in AGENTIC_SCALARS:
        return version
    for function in _agentic(f"{family}@{curve.digest()}", curve):
        _CONFIGURED.setdefault(function.version, function)
    return f"{version}@{curve.digest()}"


def function_of(version: str) -> RewardFunction:
    """The reward function a version names (KeyError for one never built here)."""
    return FUNCTIONS.get(version) or _CONFIGURED[version]


def is_defaulted(telemetry: Sequence[telemetry_pb2.TelemetryEvent]) -> bool:
    signals = {"persistence", "followup", "edit_outcome"}
    return not any(e.WhichOneof("payload") in signals for e in telemetry)


def from_its_client(
    rollout: rollout_pb2.RolloutRecord, telemetry: Sequence[telemetry_pb2.TelemetryEvent]
) -> list[telemetry_pb2.TelemetryEvent]:
    """The telemetry that may count toward the rollout's reward: when the rollout was served
    to a client's API key, only events that client's key sent (the gateway stamps client_id);
    another client cannot move a reward by naming a rollout it was not served."""
    if not rollout.client_id:
        return list(telemetry)
    return [e for e in telemetry if e.client_id == rollout.client_id]


def reward_record(
    rollout: rollout_pb2.RolloutRecord,
    telemetry: Sequence[telemetry_pb2.TelemetryEvent],
    settled_ts_ms: int,
    version: str = REWARD_FN_VERSION,
    *,
    with_rollout: bool = True,
    links: Sequence[rollout_pb2.RolloutRecord] = (),
) -> reward_pb2.RewardRecord:
    """The RewardRecord for a settled rollout; ``telemetry`` excludes the RolloutRecord.
    An agent's chain: ``rollout`` is its final link, scored; ``links`` the others, whose
    events count among the reward's (link_rewards gives each its own record).

    ``with_rollout=False`` leaves the rollout field empty, for a caller that splices
    the rollout's original bytes in (encode_with_rollout)."""
    function = function_of(version)
    telemetry = from_its_client(rollout, telemetry)
    parts = function.components(rollout, telemetry)
    event_ids = sorted(
        {rollout.event_id, *(link.event_id for link in links), *(e.event_id for e in telemetry)}
    )
    record = reward_pb2.RewardRecord(
        reward_id=reward_id(rollout.rollout_id, event_ids, version),
        rollout_id=rollout.rollout_id,
        components=parts,
        reward=function.scalar(parts),
        reward_fn_version=version,
        discarded=function.discards is not None and function.discards(parts),
        defaulted=is_defaulted(telemetry),
        last_event_ts_ms=max((rollout.client_ts_ms, *(e.client_ts_ms for e in telemetry))),
        settled_ts_ms=settled_ts_ms,
        event_ids=event_ids,
    )
    if with_rollout:
        record.rollout.CopyFrom(rollout)
    return record


def link_rewards(
    record: reward_pb2.RewardRecord, links: Sequence[rollout_pb2.RolloutRecord]
) -> list[reward_pb2.RewardRecord]:
    """The reward of an agent's chain (``record``, of its final link, built without its
    rollout) for each of its other ``links``: the same reward, each under its own id."""
    out = []
    for link in links:
        each = reward_pb2.RewardRecord()
        each.CopyFrom(record)
        each.reward_id = reward_id(
            f"{record.rollout_id}#{link.link.position}", record.event_ids, record.reward_fn_version
        )
        out.append(each)
    return out
