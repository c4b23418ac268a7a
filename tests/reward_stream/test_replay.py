"""Replay: rewards recomputed from retained telemetry with r1 and r2, deterministically,
without moving the live joiner's offsets."""

from __future__ import annotations

import random
import time

import pytest
from confluent_kafka import OFFSET_INVALID, Consumer, Producer, TopicPartition

from rtrl import kafka, signing, topics
from rtrl.reward_stream import replay, reward
from rtrl.reward_stream.authn import Authenticator
from rtrl.reward_stream.config import RewardStreamSettings
from rtrl.v1 import reward_pb2, rollout_pb2
from rtrl_client.v1 import telemetry_pb2
from support.signing import produce_as_its_writer

N_ROLLOUTS = 12
# An hour ago: the broker stamps records with the time they are produced, and a replay
# skips records whose event time is outside the join's window around that stamp.
BASE_MS = int(time.time() * 1000) - 3_600_000
EDIT_TEXT = "def f():\n    return 1\n"
CONFIG = RewardStreamSettings().join_config()


def scenario(
    i: int,
) -> tuple[rollout_pb2.RolloutRecord, list[tuple[str, telemetry_pb2.TelemetryEvent]]]:
    """Rollout i and its telemetry. i % 3: 0 kept after 90 s, 1 rewritten + annoyed, 2 nothing;
    every fourth makes a broken tool call."""
    rollout_id = f"rollout-{i:02d}"
    ts = BASE_MS + i * 10
    record = rollout_pb2.RolloutRecord(
        event_id=f"{rollout_id}-r",
        rollout_id=rollout_id,
        client_ts_ms=ts,
        completion_text=EDIT_TEXT,
        completion_token_ids=[7] * 20,
        latency_s=0.1,
        tool_calls=[rollout_pb2.ToolCall(name="run", valid=i % 4 != 0)],
        version_spans=[rollout_pb2.VersionSpan(policy_version=1, start=0, end=20)],
    )

    def ev(suffix: str, offset_ms: int, **payload) -> telemetry_pb2.TelemetryEvent:
        return telemetry_pb2.TelemetryEvent(
            event_id=f"{rollout_id}-{suffix}",
            rollout_id=rollout_id,
            client_ts_ms=ts + offset_ms,
            **payload,
        )

    events = []
    if i % 3 in (0, 1):
        region = EDIT_TEXT if i % 3 == 0 else "x = 2\n"
        events.append(
            (topics.EDIT, ev("s", 20, edit_shown=telemetry_pb2.EditShown(edit_text=EDIT_TEXT)))
        )
        events.append(
            (
                topics.PERSISTENCE,
                ev(
                    "p",
                    300,
                    persistence=telemetry_pb2.PersistenceSnapshot(
                        seconds_after_edit=90, region_text=region
                    ),
                ),
            )
        )
    if i % 3 == 1:
        events.append(
            (
                topics.FOLLOWUP,
                ev("f", 150, followup=telemetry_pb2.FollowUp(message="no, that's wrong")),
            )
        )
    return record, events


def retained() -> list[replay.RetainedRecord]:
    """The scenarios as records on 4 partitions (rollout i on partition i % 4), plus noise."""
    out = []
    for i in range(N_ROLLOUTS):
        record, events = scenario(i)
        out.append(
            replay.RetainedRecord(
                topics.ROLLOUT, i % 4, record.rollout_id.encode(), record.SerializeToString()
            )
        )
        out.extend(
            replay.RetainedRecord(t, i % 4, e.rollout_id.encode(), e.SerializeToString())
            for t, e in events
        )
    return out


def expected(version: str) -> dict[str, reward_pb2.RewardRecord]:
    out = {}
    for i in range(N_ROLLOUTS):
        record, events = scenario(i)
        telemetry = [e for _, e in events]
        rec = reward.reward_record(record, telemetry, 0, version)
        out[rec.rollout_id] = rec
    return out


@pytest.mark.parametrize("version", ["r1", "r2"])
def test_rejoin_is_deterministic_whatever_the_arrival_order(version):
    records = retained()
    first = replay.rejoin(records, CONFIG, version)
    shuffled = random.Random(7).sample(records, len(records))
    # Redeliveries and garbage change nothing but the skip count.
    noise = [
        records[0],
        records[1],
        replay.RetainedRecord(topics.EDIT, 0, b"garbage", b"\xff\xff not protobuf"),
    ]
    second = replay.rejoin(shuffled + noise, CONFIG, version)
    assert first.records == second.records and (first.skipped, second.skipped) == (0, 1)
    assert (first.dropped, first.late) == (0, 0)
    want = expected(version)
    assert sorted(r.rollout_id for r in first.records) == sorted(want)
    for rec in first.records:
        assert rec.reward_fn_version == version
        assert (rec.reward_id, rec.components, rec.reward) == (
            want[rec.rollout_id].reward_id,
            want[rec.rollout_id].components,
            want[rec.rollout_id].reward,
        )


def test_rejoin_refuses_an_unknown_version():
    with pytest.raises(KeyError):
        replay.rejoin(retained(), CONFIG, "r9")


def _present(value: bytes | None) -> bytes:
    """A field of a read-back record that the test knows is set (typed Optional)."""
    assert value is not None
    return value


def by_reward_id(records) -> dict[str, reward_pb2.RewardRecord]:
    return {r.reward_id: r for r in records}


def committed(settings, group: str) -> list[tuple[str, int, int]]:
    consumer = Consumer(kafka.consumer_config(settings, group))
    try:
        tps = consumer.committed(kafka.partitions(settings, topics.TELEMETRY), timeout=10)
        return sorted((tp.topic, tp.partition, tp.offset) for tp in tps)
    finally:
        consumer.close()


@pytest.mark.integration
def test_replay_against_the_broker(stack_settings):
    producer = Producer(kafka.producer_config(stack_settings))
    for i in range(N_ROLLOUTS):
        record, events = scenario(i)
        produce_as_its_writer(
            producer, topics.ROLLOUT, record.SerializeToString(), record.rollout_id
        )
        for topic, event in events:
            value = event.SerializeToString()
            produce_as_its_writer(producer, topic, value, record.rollout_id)
    garbage = b"\xff\xff not protobuf"  # authenticated, so it is the decode that refuses it
    produce_as_its_writer(producer, topics.EDIT, garbage, "garbage")
    # Rollouts written straight to the broker by someone who is not a worker.
    stranger = signing.Signer(signing.generate_private_key(), signing.Purpose.ROLLOUT)
    for rollout_id, sign in (("forged-unsigned", None), ("forged-stranger", stranger)):
        record, _ = scenario(0)
        record.rollout_id = rollout_id
        value = record.SerializeToString()
        producer.produce(
            topics.ROLLOUT, value, key=rollout_id, headers=list(sign.headers(value)) if sign else []
        )
    # An event written straight to the broker, not through the gateway: a user's anger, forged.
    forged = telemetry_pb2.TelemetryEvent(
        event_id="forged-anger",
        rollout_id=scenario(0)[0].rollout_id,
        client_ts_ms=scenario(0)[0].client_ts_ms + 1,
        followup=telemetry_pb2.FollowUp(seconds_after_edit=1, message="this is wrong, undo it"),
    )
    producer.produce(topics.FOLLOWUP, forged.SerializeToString(), key=forged.rollout_id)
    assert producer.flush(10) == 0
    producer.close()

    # The live joiner has consumed part of the stream: its committed offsets must not move.
    live_group = RewardStreamSettings().app_id
    live = Consumer(kafka.consumer_config(stack_settings, live_group))
    live.commit(
        offsets=[
            TopicPartition(topics.ROLLOUT, p, 1) for p in range(stack_settings.kafka_partitions)
        ],
        asynchronous=False,
    )
    live.close()
    live_before = committed(stack_settings, live_group)
    assert {offset for t, _, offset in live_before if t == topics.ROLLOUT} == {1}

    writers = Authenticator.of(RewardStreamSettings())
    results = {
        version: replay.replay(stack_settings, CONFIG, version, authenticator=writers)
        for version in ("r1", "r2")
    }
    again = replay.replay(stack_settings, CONFIG, "r2", write=False, authenticator=writers)

    for version, result in results.items():
        assert sorted(r.rollout_id for r in result.records) == sorted(
            expected(version)
        )  # one per rollout, none forged
        assert {r.reward_fn_version for r in result.records} == {version}
        # The garbage, two forged rollouts and the forged event.
        assert (result.skipped, result.unauthenticated) == (4, 3)
        written = replay.read_retained(stack_settings, (topics.reward_replay(version),))
        assert by_reward_id(
            reward_pb2.RewardRecord.FromString(_present(r.value)) for r in written
        ) == by_reward_id(result.records)
        assert all(
            r.key == reward_pb2.RewardRecord.FromString(_present(r.value)).rollout_id.encode()
            for r in written
        )
    assert by_reward_id(again.records) == by_reward_id(
        results["r2"].records
    )  # same inputs => same ids, same rewards
    r1_ids = {r.reward_id for r in results["r1"].records}
    assert r1_ids.isdisjoint(r.reward_id for r in results["r2"].records)
    # Different functions, different rewards on the same rollouts: r2 punishes the broken call harder.
    by_id = {v: {r.rollout_id: r.reward for r in res.records} for v, res in results.items()}
    assert (
        by_id["r2"]["rollout-08"] < by_id["r1"]["rollout-08"]
    )  # nothing observed, broken tool call

    assert committed(stack_settings, live_group) == live_before
    assert {offset for _, _, offset in committed(stack_settings, "rtrl-reward-replay")} == {
        OFFSET_INVALID
    }  # never committed
    assert (
        replay.read_retained(stack_settings, (topics.REWARD,)) == []
    )  # the live reward topic stays untouched
