"""Topic names: the wire contract between services (see ARCHITECTURE.md)."""

from __future__ import annotations

EDIT = "telemetry.edit.v1"
PERSISTENCE = "telemetry.persistence.v1"
FOLLOWUP = "telemetry.followup.v1"
ROLLOUT = "telemetry.rollout.v1"
REWARD = "rl.reward.v1"
REWARD_LATE = "rl.reward.v1.late"
REWARD_DLQ = "rl.reward.v1.dlq"
TRAINER_STEPS = "rl.trainer.steps.v1"

# Co-partitioned by rollout_id: one joiner partition sees everything about a rollout.
TELEMETRY = (EDIT, PERSISTENCE, FOLLOWUP, ROLLOUT)
ALL = (*TELEMETRY, REWARD, REWARD_LATE, REWARD_DLQ, TRAINER_STEPS)

# Which topic an ingest event goes to, by the TelemetryEvent payload it carries.
BY_PAYLOAD = {
    "edit_shown": EDIT,
    "edit_outcome": EDIT,
    "persistence": PERSISTENCE,
    "followup": FOLLOWUP,
}


def reward_replay(version: str) -> str:
    """Where a replay with reward-function ``version`` writes; created on demand, never by the stack."""
    return f"rl.reward.replay.{version}"
