"""The joiner authenticates what it sets aside on rl.reward.v1.late to the analytics sink (which
stores only what verifies), for a purpose of its own: a late record holds an event's or a
rollout's bytes, which must never verify as a reward."""

from __future__ import annotations

from rtrl import signing, topics
from rtrl.reward_stream.app import _joiner
from rtrl.reward_stream.config import RewardStreamSettings
from rtrl.v1 import rollout_pb2
from rtrl_client.v1 import telemetry_pb2
from support.signing import worker_headers

NOW = 1_800_000_000_000


def feed(joiner, topic: str, offset: int, message, now_ms: int):
    value = message.SerializeToString()
    return joiner.feed_record(
        topic, 0, offset, b"r1", value, now_ms, headers=worker_headers(topic, value)
    ).records


def test_the_joiner_authenticates_its_late_records_for_their_own_purpose():
    settings = RewardStreamSettings(window_s=1, grace_s=0)
    joiner = _joiner(settings)  # as the service builds it
    rollout = rollout_pb2.RolloutRecord(event_id="a1", rollout_id="r1", client_ts_ms=NOW)
    assert feed(joiner, topics.ROLLOUT, 0, rollout, NOW) == []
    [settled] = joiner.tick(NOW + 10_000)
    assert settled.topic == topics.REWARD
    followup = telemetry_pb2.TelemetryEvent(
        event_id="a2",
        rollout_id="r1",
        client_ts_ms=NOW + 100,
        followup=telemetry_pb2.FollowUp(message="no"),
    )
    [late] = feed(joiner, topics.FOLLOWUP, 0, followup, NOW + 11_000)

    assert late.topic == topics.REWARD_LATE
    # The sink's key: the only reader of .late.
    sinks = [settings.analytics_mac_key.get_secret_value()]
    as_late = signing.MacVerifier(sinks, signing.Purpose.REWARD_LATE)
    assert as_late.problem(late.value, late.headers) is None
    as_reward = signing.MacVerifier(sinks, signing.Purpose.REWARD)
    assert as_reward.problem(late.value, late.headers) == "bad signature"
    trainers = [settings.trainer_mac_key.get_secret_value()]
    assert signing.MacVerifier(trainers, signing.Purpose.REWARD).problem(
        late.value, late.headers
    ), "nothing the trainer takes"
    assert dict(late.headers)["source_topic"] == topics.FOLLOWUP.encode()
