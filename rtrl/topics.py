"""Topic names: the wire contract between services (see docs/architecture.md)."""

from __future__ import annotations

from dataclasses import dataclass

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


# What each service does on the broker: the "produced by / consumed by" of docs/operations.md,
# as the compose brokers' ACLs grant it (ops/kafka_acls.py renders them). A name ending in
# "*" is a prefix. Read by rtrl.ops.kafka_acls and tests/ops/test_compose.py.
@dataclass(frozen=True)
class Access:
    writes: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()
    """Consumer groups it joins, or whose offsets it reads (an assign()-only reader still names one)."""


ACCESS = {
    # Writes telemetry; its recovery sweep reads back what it wrote (kafka.end_offsets too).
    "ingest": Access(
        writes=(EDIT, PERSISTENCE, FOLLOWUP),
        reads=(EDIT, PERSISTENCE, FOLLOWUP),
        groups=("rtrl-ingest-recovery", "rtrl-end-offsets"),
    ),
    "inference": Access(writes=(ROLLOUT,)),
    # The joiner: faust's group and its internal topics (prefix), the read-backs of its outputs.
    "reward_stream": Access(
        writes=(REWARD, REWARD_LATE, REWARD_DLQ, "rtrl-reward-stream-*"),
        reads=(*TELEMETRY, REWARD, REWARD_LATE, "rtrl-reward-stream-*"),
        groups=("rtrl-reward-stream", "rtrl-reward-recovery", "rtrl-end-offsets"),
    ),
    # The trainer reads rewards (or a replay) and dead-letters the ones that do not verify.
    "trainer": Access(
        writes=(TRAINER_STEPS, REWARD_DLQ),
        reads=(REWARD, "rl.reward.replay.*"),
        groups=("trainer",),
    ),
    "analytics": Access(reads=ALL, groups=("analytics", "rtrl-end-offsets")),
}
