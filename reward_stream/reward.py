"""Reward function r1: from a rollout and the user signals joined to it, one scalar.

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

A reward is ``defaulted`` when no user signal (persistence snapshot, follow-up or
edit outcome) was joined, i.e. it rests only on the defaults above.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from reward_stream.signals import is_dissatisfied, persisted_fraction
from rtrl.v1 import reward_pb2, rollout_pb2, telemetry_pb2

REWARD_FN_VERSION = "r1"
PERSISTENCE_DEFAULT = 0.5
DISSATISFIED_WEIGHT = 0.5
INVALID_TOOL_WEIGHT = 0.5
EFFORT_PER_TOKEN = 0.0005
EFFORT_CAP = 0.05

# Fixed namespace so reward ids are stable across processes and releases.
REWARD_ID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://rtrl/reward_id")

_REJECTED = telemetry_pb2.EditOutcome.OUTCOME_REJECTED


def _newest(events: Sequence[telemetry_pb2.TelemetryEvent], payload: str) -> telemetry_pb2.TelemetryEvent | None:
    matching = [e for e in events if e.WhichOneof("payload") == payload]
    # max keeps the first of equal timestamps; reversed makes it the last to arrive.
    return max(reversed(matching), key=lambda e: e.client_ts_ms) if matching else None


def components(
    rollout: rollout_pb2.RolloutRecord, telemetry: Sequence[telemetry_pb2.TelemetryEvent]
) -> reward_pb2.RewardComponents:
    shown = _newest(telemetry, "edit_shown")
    snapshot = _newest(telemetry, "persistence")
    outcome = _newest(telemetry, "edit_outcome")
    followups = [e.followup.message for e in telemetry if e.WhichOneof("payload") == "followup"]

    if snapshot is not None:
        agent_text = shown.edit_shown.edit_text if shown is not None else rollout.completion_text
        persisted = persisted_fraction(agent_text, snapshot.persistence.region_text)
    elif outcome is not None and outcome.edit_outcome.outcome == _REJECTED:
        persisted = 0.0
    else:
        persisted = PERSISTENCE_DEFAULT

    calls = rollout.tool_calls
    validity = sum(call.valid for call in calls) / len(calls) if calls else 1.0
    return reward_pb2.RewardComponents(
        persisted_fraction=persisted,
        persistence_observed=snapshot is not None,
        dissatisfied=1.0 if any(is_dissatisfied(m) for m in followups) else 0.0,
        followup_observed=bool(followups),
        tool_call_validity=validity,
        effort_penalty=min(EFFORT_CAP, EFFORT_PER_TOKEN * len(rollout.completion_token_ids)),
        latency_s=rollout.latency_s,
    )


def reward(c: reward_pb2.RewardComponents) -> float:
    """The r1 scalar (see the module docstring); in [-1.05, 1.0]."""
    return (
        c.persisted_fraction
        - DISSATISFIED_WEIGHT * c.dissatisfied
        - INVALID_TOOL_WEIGHT * (1.0 - c.tool_call_validity)
        - c.effort_penalty
    )


def reward_id(rollout_id: str, event_ids: Sequence[str], version: str = REWARD_FN_VERSION) -> str:
    """Same rollout, same contributing events, same reward function => same id."""
    name = "\x1f".join((version, rollout_id, *sorted(event_ids)))
    return str(uuid.uuid5(REWARD_ID_NAMESPACE, name))


def is_defaulted(telemetry: Sequence[telemetry_pb2.TelemetryEvent]) -> bool:
    signals = {"persistence", "followup", "edit_outcome"}
    return not any(e.WhichOneof("payload") in signals for e in telemetry)


def reward_record(
    rollout: rollout_pb2.RolloutRecord,
    telemetry: Sequence[telemetry_pb2.TelemetryEvent],
    settled_ts_ms: int,
) -> reward_pb2.RewardRecord:
    """The RewardRecord for a settled rollout; ``telemetry`` excludes the RolloutRecord."""
    parts = components(rollout, telemetry)
    event_ids = sorted({rollout.event_id, *(e.event_id for e in telemetry)})
    return reward_pb2.RewardRecord(
        reward_id=reward_id(rollout.rollout_id, event_ids),
        rollout_id=rollout.rollout_id,
        rollout=rollout,
        components=parts,
        reward=reward(parts),
        reward_fn_version=REWARD_FN_VERSION,
        defaulted=is_defaulted(telemetry),
        last_event_ts_ms=max((rollout.client_ts_ms, *(e.client_ts_ms for e in telemetry))),
        settled_ts_ms=settled_ts_ms,
        event_ids=event_ids,
    )
