"""`python -m reward_stream` against a real Tansu: one reward per rollout, garbage to the DLQ,
late events to .late, clean exit on SIGTERM."""

from __future__ import annotations

import json
import sys
import time
import uuid

import pytest
import redis
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition
from signing_support import worker_headers

from rtrl import heartbeat, kafka, procs, topics
from rtrl.v1 import reward_pb2, rollout_pb2, telemetry_pb2
from simulator.tasks import Style, Task

pytestmark = pytest.mark.integration

N_ROLLOUTS = 20
GARBAGE = b"\xff\xff\xff not protobuf"
ACCEPTED = telemetry_pb2.EditOutcome(outcome=telemetry_pb2.EditOutcome.OUTCOME_ACCEPTED)


def scenario(i: int, base_ms: int):
    """The records of rollout i and the components its reward must have.

    i % 4: 0 edit kept, 1 edit re-indented + annoyed follow-up, 2 neutral follow-up
    only, 3 nothing but the RolloutRecord. Every fifth rollout made one invalid tool call.
    """
    rollout_id = f"rollout-{i:02d}"
    task = Task(project=0, verb="say", word="hi")
    agent = task.render(Style(2, "'"))
    ts = base_ms + i * 10

    def event(offset_ms: int, **payload) -> telemetry_pb2.TelemetryEvent:
        return telemetry_pb2.TelemetryEvent(
            event_id=str(uuid.uuid4()), rollout_id=rollout_id, session_id="s", client_ts_ms=ts + offset_ms, **payload
        )

    calls = [rollout_pb2.ToolCall(name="edit", valid=True)] + ([rollout_pb2.ToolCall(name="run", valid=False)] if i % 5 == 0 else [])
    record = rollout_pb2.RolloutRecord(
        event_id=str(uuid.uuid4()), rollout_id=rollout_id, client_ts_ms=ts, completion_text=agent,
        completion_token_ids=[7] * 20, tool_calls=calls, latency_s=0.1,
    )
    events = []
    if i % 4 in (0, 1):
        events.append((topics.EDIT, event(20, edit_shown=telemetry_pb2.EditShown(edit_text=agent))))
        events.append((topics.EDIT, event(30, edit_outcome=ACCEPTED)))
        region = agent if i % 4 == 0 else task.render(Style(4, "'"))
        events.append((topics.PERSISTENCE, event(200, persistence=telemetry_pb2.PersistenceSnapshot(region_text=region))))
    if i % 4 == 1:
        events.append((topics.FOLLOWUP, event(150, followup=telemetry_pb2.FollowUp(message="no, use 4 spaces instead"))))
    if i % 4 == 2:
        events.append((topics.FOLLOWUP, event(150, followup=telemetry_pb2.FollowUp(message="thanks"))))
    expected = {
        "persisted_fraction": {0: 1.0, 1: 0.5}.get(i % 4, 0.5),
        "persistence_observed": i % 4 in (0, 1),
        "dissatisfied": 1.0 if i % 4 == 1 else 0.0,
        "followup_observed": i % 4 in (1, 2),
        "tool_call_validity": 0.5 if i % 5 == 0 else 1.0,
        "defaulted": i % 4 == 3,
        "event_ids": sorted([record.event_id, *(e.event_id for _, e in events)]),
    }
    return rollout_id, record, events, expected


def wait_for_heartbeat(client: redis.Redis, predicate, timeout_s: float = 90.0) -> dict:
    deadline = time.monotonic() + timeout_s
    doc: dict = {}
    while time.monotonic() < deadline:
        raw = client.get(heartbeat.key("reward_stream", "0"))
        doc = json.loads(raw) if raw else {}
        if doc and predicate(doc):
            return doc
        time.sleep(0.2)
    raise AssertionError(f"heartbeat never matched; last: {doc}")


def test_one_reward_per_rollout_dlq_late_and_clean_stop(stack_settings, stack_env, redis_url, tmp_path):
    env = {**stack_env, "RTRL_REWARD_WINDOW_S": "1", "RTRL_REWARD_WEB_PORT": str(procs.free_port())}
    service = procs.spawn("reward_stream", [sys.executable, "-m", "reward_stream"], tmp_path / "reward_stream.log", env=env)
    try:
        base_ms = int(time.time() * 1000)
        scenarios = {rid: (record, events, expected) for rid, record, events, expected in (scenario(i, base_ms) for i in range(N_ROLLOUTS))}
        producer = Producer(kafka.producer_config(stack_settings))
        for rollout_id, (record, events, _) in scenarios.items():
            producer.produce(topics.ROLLOUT, record.SerializeToString(), key=rollout_id, headers=worker_headers(topics.ROLLOUT, record.SerializeToString()))
            for topic, event in events:
                producer.produce(topic, event.SerializeToString(), key=rollout_id)
        # Redeliveries: a RolloutRecord, a persistence snapshot, a follow-up.
        duplicates = [
            (topics.ROLLOUT, scenarios["rollout-00"][0]),
            (topics.PERSISTENCE, scenarios["rollout-01"][1][2][1]),
            (topics.FOLLOWUP, scenarios["rollout-02"][1][0][1]),
        ]
        for topic, message in duplicates:
            producer.produce(topic, message.SerializeToString(), key=message.rollout_id, headers=worker_headers(topic, message.SerializeToString()))
        producer.produce(topics.EDIT, GARBAGE, key="garbage")
        assert producer.flush(10) == 0

        hb = redis.Redis.from_url(redis_url)
        wait_for_heartbeat(hb, lambda d: d["settled"] >= N_ROLLOUTS and d["dlq"] >= 1)
        # An event for an already-settled rollout goes to .late.
        late = telemetry_pb2.TelemetryEvent(
            event_id="late-1", rollout_id="rollout-03", client_ts_ms=base_ms + 5000, followup=telemetry_pb2.FollowUp(message="ugh")
        )
        producer.produce(topics.FOLLOWUP, late.SerializeToString(), key="rollout-03")
        assert producer.flush(10) == 0
        status = wait_for_heartbeat(hb, lambda d: d["late"] >= 1)
        assert {k: status[k] for k in ("settled", "defaulted", "duplicates", "dlq", "late", "pending", "dropped")} == {
            "settled": N_ROLLOUTS, "defaulted": N_ROLLOUTS // 4, "duplicates": len(duplicates),
            "dlq": 1, "late": 1, "pending": 0, "dropped": 0,
        }

        out = read_all(stack_settings, (topics.REWARD, topics.REWARD_DLQ, topics.REWARD_LATE))
        rewards = [reward_pb2.RewardRecord.FromString(m.value()) for m in out[topics.REWARD]]
        assert sorted(r.rollout_id for r in rewards) == sorted(scenarios)  # exactly one each
        for msg, rec in zip(out[topics.REWARD], rewards):
            record, _, expected = scenarios[rec.rollout_id]
            assert msg.key() == rec.rollout_id.encode()
            assert rec.rollout == record
            c = rec.components
            got = {name: getattr(c, name) for name in expected if hasattr(c, name)}
            got.update(defaulted=rec.defaulted, event_ids=list(rec.event_ids))
            assert got == expected, rec.rollout_id
            assert rec.reward == pytest.approx(
                c.persisted_fraction - 0.5 * c.dissatisfied - 0.5 * (1 - c.tool_call_validity) - 0.01
            )

        [dead] = out[topics.REWARD_DLQ]
        assert dead.value() == GARBAGE and dead.key() == b"garbage"
        assert dict(dead.headers())["error"].startswith(b"protobuf decode failed")
        [late_msg] = out[topics.REWARD_LATE]
        assert telemetry_pb2.TelemetryEvent.FromString(late_msg.value()) == late
    finally:
        service.stop(timeout_s=20)
    assert service.popen.returncode == 0, (tmp_path / "reward_stream.log").read_text()[-3000:]


def read_all(settings, topic_names: tuple[str, ...]) -> dict[str, list]:
    """Every record in the given topics, read by assignment (no group join needed)."""
    pairs = [(t, p) for t in topic_names for p in range(settings.kafka_partitions)]
    ends = kafka.end_offsets(settings, [TopicPartition(t, p) for t, p in pairs])
    tps = [TopicPartition(t, p, OFFSET_BEGINNING) for t, p in pairs]
    consumer = Consumer({"bootstrap.servers": settings.kafka_bootstrap, "group.id": "test-read", "enable.auto.commit": False})
    consumer.assign(tps)
    records: dict[str, list] = {t: [] for t in topic_names}
    remaining = {k for k, end in ends.items() if end > 0}
    deadline = time.monotonic() + 30
    try:
        while remaining and time.monotonic() < deadline:
            for msg in consumer.consume(100, timeout=0.2):
                if msg.error() is None:
                    records[msg.topic()].append(msg)
                    if msg.offset() + 1 >= ends[(msg.topic(), msg.partition())]:
                        remaining.discard((msg.topic(), msg.partition()))
    finally:
        consumer.close()
    assert not remaining, f"could not read up to the end of {remaining}"
    return records
