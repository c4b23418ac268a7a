"""Kill -9 the joiner in the middle of 10,000 rollouts, restart it: exactly one reward
per rollout, nothing lost, nothing doubled, and the consumer group ends committed
at the end of every input partition (acks do advance the offsets).

Guarantee 1 of ARCHITECTURE.md, for the reward stream, against a real Tansu.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from collections import Counter

import pytest
from confluent_kafka import Producer, TopicPartition
from test_reward_stream_service import read_all

from rtrl import kafka, procs, topics
from rtrl.v1 import reward_pb2, rollout_pb2, telemetry_pb2

pytestmark = [pytest.mark.integration, pytest.mark.slow]

N_ROLLOUTS = 10_000


def produce_rollouts(settings, base_ms: int) -> set[str]:
    """N rollouts of three records each (RolloutRecord, EditShown, PersistenceSnapshot),
    2 ms of event time apart, so stream time keeps settling earlier ones."""
    producer = Producer(kafka.producer_config(settings))
    ids = set()
    for i in range(N_ROLLOUTS):
        rollout_id = f"r{i:05d}"
        ts = base_ms + 2 * i
        record = rollout_pb2.RolloutRecord(
            event_id=str(uuid.uuid4()), rollout_id=rollout_id, client_ts_ms=ts, completion_text="x = 1\n", completion_token_ids=[7] * 4
        )
        shown = telemetry_pb2.TelemetryEvent(
            event_id=str(uuid.uuid4()), rollout_id=rollout_id, client_ts_ms=ts + 1, edit_shown=telemetry_pb2.EditShown(edit_text="x = 1\n")
        )
        kept = telemetry_pb2.TelemetryEvent(
            event_id=str(uuid.uuid4()), rollout_id=rollout_id, client_ts_ms=ts + 2,
            persistence=telemetry_pb2.PersistenceSnapshot(region_text="x = 1\n"),
        )
        producer.produce(topics.ROLLOUT, record.SerializeToString(), key=rollout_id)
        producer.produce(topics.EDIT, shown.SerializeToString(), key=rollout_id)
        producer.produce(topics.PERSISTENCE, kept.SerializeToString(), key=rollout_id)
        producer.poll(0)
        ids.add(rollout_id)
    assert producer.flush(30) == 0
    return ids


def rewards_written(settings) -> int:
    ends = kafka.end_offsets(settings, [TopicPartition(topics.REWARD, p) for p in range(settings.kafka_partitions)])
    return sum(ends.values())


def test_kill_9_mid_stream_loses_and_doubles_nothing(stack_settings, stack_env, tmp_path):
    env = {**stack_env, "RTRL_REWARD_WINDOW_S": "1", "RTRL_REWARD_GRACE_S": "0.2"}

    def start() -> procs.Proc:
        env["RTRL_REWARD_WEB_PORT"] = str(procs.free_port())
        return procs.spawn("reward_stream", [sys.executable, "-m", "reward_stream"], tmp_path / "reward_stream.log", env=env)

    ids = produce_rollouts(stack_settings, int(time.time() * 1000))
    service = start()
    try:
        deadline = time.monotonic() + 120
        while rewards_written(stack_settings) < N_ROLLOUTS // 4:
            assert time.monotonic() < deadline, "the joiner settled too little before the kill"
            assert service.popen.poll() is None, (tmp_path / "reward_stream.log").read_text()[-3000:]
            time.sleep(0.05)
        os.killpg(service.pid, signal.SIGKILL)
        service.popen.wait()
        killed_at = rewards_written(stack_settings)
        assert killed_at < N_ROLLOUTS, "the kill came after everything had settled; it proves nothing"

        service = start()
        deadline = time.monotonic() + 180
        while rewards_written(stack_settings) < N_ROLLOUTS:
            assert time.monotonic() < deadline, f"only {rewards_written(stack_settings)} of {N_ROLLOUTS} rewards after the restart"
            time.sleep(0.2)
        time.sleep(3)  # anything doubled would still be on its way
        lag = kafka.consumer_lag(stack_settings, "rtrl-reward-stream", topics.TELEMETRY)
    finally:
        service.stop(timeout_s=20)

    rewards = [reward_pb2.RewardRecord.FromString(m.value()) for m in read_all(stack_settings, (topics.REWARD,))[topics.REWARD]]
    per_rollout = Counter(r.rollout_id for r in rewards)
    assert set(per_rollout) == ids
    assert max(per_rollout.values()) == 1, [rid for rid, n in per_rollout.items() if n > 1][:5]
    assert len({r.reward_id for r in rewards}) == N_ROLLOUTS
    assert all(len(r.event_ids) == 3 and not r.defaulted for r in rewards)
    assert killed_at >= N_ROLLOUTS // 4
    # Every input partition committed to its end. (Tansu can report a committed offset
    # past what end_offsets finds, a quirk of its batch offsets; never one short of it.)
    assert [(p.topic, p.partition, p.committed, p.end) for p in lag if p.lag > 0] == []
