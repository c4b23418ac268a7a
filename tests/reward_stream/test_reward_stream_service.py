"""`python -m rtrl.reward_stream` against a real Tansu: one reward per rollout, garbage to the DLQ,
late events to .late, clean exit on SIGTERM."""

from __future__ import annotations

import time

import pytest
import redis
from confluent_kafka import Producer

from rtrl import kafka, topics
from rtrl.heartbeat import RewardStreamBeat
from rtrl.v1 import reward_pb2
from rtrl_client.v1 import telemetry_pb2
from support.beats import wait_for_beat
from support.reward_stream import read_all, scenario, spawn_joiner
from support.signing import produce_as_its_writer, worker_headers

pytestmark = pytest.mark.integration

N_ROLLOUTS = 20
GARBAGE = b"\xff\xff\xff not protobuf"


@pytest.mark.guarantee(2)
def test_one_reward_per_rollout_dlq_late_and_clean_stop(
    stack_settings, stack_env, redis_url, tmp_path
):
    service = spawn_joiner(stack_env, tmp_path)
    try:
        base_ms = int(time.time() * 1000)
        scenarios = {
            rid: (record, events, expected)
            for rid, record, events, expected in (scenario(i, base_ms) for i in range(N_ROLLOUTS))
        }
        producer = Producer(kafka.producer_config(stack_settings))
        for rollout_id, (record, events, _) in scenarios.items():
            producer.produce(
                topics.ROLLOUT,
                record.SerializeToString(),
                key=rollout_id,
                headers=kafka.kafka_headers(
                    worker_headers(topics.ROLLOUT, record.SerializeToString())
                ),
            )
            for topic, event in events:
                value = event.SerializeToString()
                produce_as_its_writer(producer, topic, value, rollout_id)
        # Redeliveries: a RolloutRecord, a persistence snapshot, a follow-up.
        duplicates = [
            (topics.ROLLOUT, scenarios["rollout-00"][0]),
            (topics.PERSISTENCE, scenarios["rollout-01"][1][2][1]),
            (topics.FOLLOWUP, scenarios["rollout-02"][1][0][1]),
        ]
        for topic, message in duplicates:
            produce_as_its_writer(producer, topic, message.SerializeToString(), message.rollout_id)
        # Authenticated, so it is the decode that dead-letters it.
        produce_as_its_writer(producer, topics.EDIT, GARBAGE, "garbage")
        assert producer.flush(10) == 0

        hb = redis.Redis.from_url(redis_url)
        wait_for_beat(
            hb,
            RewardStreamBeat,
            "every rollout settled and the garbage dead-lettered",
            ready=lambda beat: beat.settled >= N_ROLLOUTS and beat.dlq >= 1,
        )
        # An event for an already-settled rollout goes to .late.
        late = telemetry_pb2.TelemetryEvent(
            event_id="late-1",
            rollout_id="rollout-03",
            client_ts_ms=base_ms + 5000,
            followup=telemetry_pb2.FollowUp(message="ugh"),
        )
        value = late.SerializeToString()
        produce_as_its_writer(producer, topics.FOLLOWUP, value, "rollout-03")
        assert producer.flush(10) == 0
        status = wait_for_beat(
            hb, RewardStreamBeat, "the late follow-up", ready=lambda beat: beat.late >= 1
        )
        assert {
            k: getattr(status, k)
            for k in ("settled", "defaulted", "duplicates", "dlq", "late", "pending", "dropped")
        } == {
            "settled": N_ROLLOUTS,
            "defaulted": N_ROLLOUTS // 4,
            "duplicates": len(duplicates),
            "dlq": 1,
            "late": 1,
            "pending": 0,
            "dropped": 0,
        }

        out = read_all(stack_settings, (topics.REWARD, topics.REWARD_DLQ, topics.REWARD_LATE))
        rewards = [reward_pb2.RewardRecord.FromString(m.value()) for m in out[topics.REWARD]]
        assert sorted(r.rollout_id for r in rewards) == sorted(scenarios)  # exactly one each
        for msg, rec in zip(out[topics.REWARD], rewards, strict=True):
            record, _, expected = scenarios[rec.rollout_id]
            assert msg.key() == rec.rollout_id.encode()
            assert rec.rollout == record
            c = rec.components
            got = {name: getattr(c, name) for name in expected if hasattr(c, name)}
            got.update(defaulted=rec.defaulted, event_ids=list(rec.event_ids))
            assert got == expected, rec.rollout_id
            assert rec.reward == pytest.approx(
                c.persisted_fraction
                - 0.5 * c.dissatisfied
                - 0.5 * (1 - c.tool_call_validity)
                - 0.01
            )

        [dead] = out[topics.REWARD_DLQ]
        assert dead.value() == GARBAGE and dead.key() == b"garbage"
        assert dict(dead.headers())["error"].startswith(b"protobuf decode failed")
        [late_msg] = out[topics.REWARD_LATE]
        assert telemetry_pb2.TelemetryEvent.FromString(late_msg.value()) == late
    finally:
        service.stop(timeout_s=20)
    assert service.popen.returncode == 0, (tmp_path / "reward_stream.log").read_text()[-3000:]
