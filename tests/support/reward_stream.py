"""The reward stream's scenarios and readers, shared by the reward-stream tests and the
hostile-timestamp tests: the records of a rollout with the reward components they must
give, a reader of whole topics, and the table of completions the hacking monitor counts
as clarifying questions. (The joiner's heartbeat is waited for through support.beats.)"""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from rtrl import kafka, procs, topics
from rtrl.simulator.tasks import Style, Task
from rtrl.v1 import rollout_pb2
from rtrl_client.v1 import telemetry_pb2

ACCEPTED = telemetry_pb2.EditOutcome(outcome=telemetry_pb2.EditOutcome.OUTCOME_ACCEPTED)

# Completions and whether reward_stream.monitors.is_clarifying_question says they are one.
QUESTION_CASES = {
    "plain_question": ("Which file should I change?", True),
    "question_with_trailing_space": ("Do you want tests too?  \n", True),
    "statement": ("Done, I renamed it.", False),
    "code_then_question": ("```python\nx = 1\n```\nLike this?", False),
    "indented_code_then_question": ("Change it to\n    return x\nok?", False),
    "question_mid_text": ("Why? Because the build broke.", False),
}


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
            event_id=str(uuid.uuid4()),
            rollout_id=rollout_id,
            session_id="s",
            client_ts_ms=ts + offset_ms,
            **payload,
        )

    calls = [rollout_pb2.ToolCall(name="edit", valid=True)] + (
        [rollout_pb2.ToolCall(name="run", valid=False)] if i % 5 == 0 else []
    )
    record = rollout_pb2.RolloutRecord(
        event_id=str(uuid.uuid4()),
        rollout_id=rollout_id,
        client_ts_ms=ts,
        completion_text=agent,
        completion_token_ids=[7] * 20,
        tool_calls=calls,
        latency_s=0.1,
    )
    events = []
    if i % 4 in (0, 1):
        events.append((topics.EDIT, event(20, edit_shown=telemetry_pb2.EditShown(edit_text=agent))))
        events.append((topics.EDIT, event(30, edit_outcome=ACCEPTED)))
        region = agent if i % 4 == 0 else task.render(Style(4, "'"))
        events.append(
            (
                topics.PERSISTENCE,
                event(200, persistence=telemetry_pb2.PersistenceSnapshot(region_text=region)),
            )
        )
    if i % 4 == 1:
        events.append(
            (
                topics.FOLLOWUP,
                event(150, followup=telemetry_pb2.FollowUp(message="no, use 4 spaces instead")),
            )
        )
    if i % 4 == 2:
        events.append(
            (topics.FOLLOWUP, event(150, followup=telemetry_pb2.FollowUp(message="thanks")))
        )
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


def read_all(settings, topic_names: tuple[str, ...]) -> dict[str, list]:
    """Every record in the given topics, read by assignment (no group join needed)."""
    pairs = [(t, p) for t in topic_names for p in range(settings.kafka_partitions)]
    ends = kafka.end_offsets(settings, [TopicPartition(t, p) for t, p in pairs])
    tps = [TopicPartition(t, p, OFFSET_BEGINNING) for t, p in pairs]
    consumer = Consumer(
        {
            "bootstrap.servers": settings.kafka_bootstrap,
            "group.id": "test-read",
            "enable.auto.commit": False,
        }
    )
    consumer.assign(tps)
    records: dict[str, list] = {t: [] for t in topic_names}
    remaining = {k for k, end in ends.items() if end > 0}
    deadline = time.monotonic() + 30
    try:
        while remaining and time.monotonic() < deadline:
            for msg in consumer.consume(100, timeout=0.2):
                if msg.error() is None:
                    topic, partition, offset = kafka.record_position(msg)
                    records[topic].append(msg)
                    if offset + 1 >= ends[(topic, partition)]:
                        remaining.discard((topic, partition))
    finally:
        consumer.close()
    assert not remaining, f"could not read up to the end of {remaining}"
    return records


def spawn_joiner(stack_env: dict[str, str], log_dir: Path, **settings: str) -> procs.Proc:
    """``python -m rtrl.reward_stream`` on the test's stack, logging to ``log_dir``: a 1 s window,
    its own web port, and ``settings`` as RTRL_REWARD_* variables (``grace_s="0.5"``)."""
    env = {
        **stack_env,
        "RTRL_REWARD_WINDOW_S": "1",
        "RTRL_REWARD_WEB_PORT": str(procs.free_port()),
        **{f"RTRL_REWARD_{name.upper()}": value for name, value in settings.items()},
    }
    return procs.spawn(
        "reward_stream",
        [sys.executable, "-m", "rtrl.reward_stream"],
        log_dir / "reward_stream.log",
        env=env,
    )
