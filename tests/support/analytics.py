"""Hand-made rollouts and rewards whose A/B numbers are computed by hand, and a stand-in
for the sink's Kafka consumer that records what it commits. Shared by the analytics tests,
the report's rendering, the eval gate's and the hostile-timestamp tests."""

from __future__ import annotations

from rtrl.v1 import common_pb2, reward_pb2, rollout_pb2

T0 = 1_800_000_000_000
ARMS = {"control": common_pb2.ARM_CONTROL, "treatment": common_pb2.ARM_TREATMENT}

# rollout_id, arm, policy versions of its spans, latency_s, event time (s after T0),
# persistence_observed, persisted_fraction, dissatisfied, reward
HAND_MADE = [
    ("c1", "control", [0], 0.1, 0, True, 1.0, 0.0, 1.0),  # persisted
    ("c2", "control", [0], 0.2, 100, True, 0.5, 1.0, -0.5),  # dissatisfied
    ("c3", "control", [0], 0.3, 600, False, 0.0, 0.0, 0.0),  # no snapshot: not persisted
    ("c4", "control", [0], 0.4, 900, True, 0.9995, 0.0, 0.8),  # >= 0.999 counts as persisted
    ("t1", "treatment", [1], 0.1, 0, True, 0.998, 1.0, -1.0),  # just under the threshold
    ("t2", "treatment", [1], 0.1, 200, True, 1.0, 0.0, 1.0),
    ("t3", "treatment", [2], 0.2, 500, True, 1.0, 0.0, 1.0),
    ("t4", "treatment", [2, 3], 0.3, 700, True, 1.0, 0.0, 1.0),  # swapped mid-rollout: version 3
    (
        "t5",
        "treatment",
        [3],
        0.5,
        1000,
        False,
        1.0,
        1.0,
        0.0,
    ),  # unobserved never counts as persisted
]


def rollout(rollout_id, arm, versions, latency_s, offset_s) -> rollout_pb2.RolloutRecord:
    spans = [
        rollout_pb2.VersionSpan(policy_version=v, start=4 * i, end=4 * i + 4)
        for i, v in enumerate(versions)
    ]
    return rollout_pb2.RolloutRecord(
        event_id=f"ev-{rollout_id}",
        rollout_id=rollout_id,
        session_id="s1",
        user_id="u1",
        worker_id="w0",
        client_ts_ms=T0 + offset_s * 1000,
        schema_version=1,
        arm=ARMS[arm],
        version_spans=spans,
        completion_token_ids=[7] * (4 * len(versions)),
        latency_s=latency_s,
        prompt_text="@p1 add x\n",
        completion_text="def add_x():\n    call('x')\n",
        finish_reason="eos",
    )


def reward(
    r: rollout_pb2.RolloutRecord, observed, fraction, dissatisfied, value
) -> reward_pb2.RewardRecord:
    components = reward_pb2.RewardComponents(
        persisted_fraction=fraction,
        persistence_observed=observed,
        dissatisfied=dissatisfied,
        followup_observed=dissatisfied > 0,
        tool_call_validity=1.0,
        latency_s=r.latency_s,
    )
    return reward_pb2.RewardRecord(
        reward_id=f"rw-{r.rollout_id}",
        rollout_id=r.rollout_id,
        rollout=r,
        components=components,
        reward=value,
        reward_fn_version="test-1",
        defaulted=not observed,
        last_event_ts_ms=r.client_ts_ms + 1000,
        settled_ts_ms=r.client_ts_ms + 2000,
        event_ids=[f"e-{r.rollout_id}"],
    )


def hand_made_records():
    rollouts, rewards = [], []
    for (
        rollout_id,
        arm,
        versions,
        latency_s,
        offset_s,
        observed,
        fraction,
        dissatisfied,
        value,
    ) in HAND_MADE:
        rollouts.append(rollout(rollout_id, arm, versions, latency_s, offset_s))
        rewards.append(reward(rollouts[-1], observed, fraction, dissatisfied, value))
    return rollouts, rewards


class RecordingConsumer:
    """The sink's consumer, minus Kafka: every commit it is asked for, in order."""

    def __init__(self):
        self.commits = []

    def commit(self, offsets, asynchronous):
        self.commits.append({(tp.topic, tp.partition): tp.offset for tp in offsets})
