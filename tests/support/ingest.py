"""Events to send through the ingest gateway, its settings for delivery tests, and a reader
of what landed on the telemetry topics. Shared by the ingest tests and the
hostile-timestamp tests."""

from __future__ import annotations

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from rtrl import kafka, topics
from rtrl.ingest.config import IngestSettings
from rtrl.procs import free_port
from rtrl_client.client import make_event
from rtrl_client.v1 import telemetry_pb2

INGEST_TOPICS = (topics.EDIT, topics.PERSISTENCE, topics.FOLLOWUP)


def ingest_settings(**overrides) -> IngestSettings:
    # Delivery semantics without keys; tests/ingest/test_ingest_auth.py covers authentication.
    return IngestSettings(
        http_port=free_port(), grpc_port=free_port(), **{"auth_required": False, **overrides}
    )


def shown(rollout: str, **kw):
    return make_event(
        rollout,
        "s1",
        "u1",
        edit_shown=telemetry_pb2.EditShown(file_path="a.py", edit_text="x = 1\n"),
        **kw,
    )


def persisted(rollout: str, **kw):
    return make_event(
        rollout,
        "s1",
        "u1",
        persistence=telemetry_pb2.PersistenceSnapshot(seconds_after_edit=30, region_text="x = 1\n"),
        **kw,
    )


def followup(rollout: str, **kw):
    return make_event(
        rollout,
        "s1",
        "u1",
        followup=telemetry_pb2.FollowUp(seconds_after_edit=5, message="no, that broke it"),
        **kw,
    )


def read_messages(stack_settings, names=INGEST_TOPICS) -> list:
    """Every message on the topics, from the beginning up to their end offsets, without
    joining a group (confluent-kafka Messages, in the order read)."""
    probe = Consumer(kafka.consumer_config(stack_settings, "test-reader"))
    metadata = probe.list_topics(timeout=5).topics
    tps = [TopicPartition(t, p, OFFSET_BEGINNING) for t in names for p in metadata[t].partitions]
    ends = kafka.end_offsets(stack_settings, tps)
    remaining = {k: v for k, v in ends.items() if v > 0}
    messages = []
    probe.assign(tps)
    try:
        for _ in range(100):
            if not remaining:
                break
            for msg in probe.consume(100, timeout=0.2):
                assert msg.error() is None, msg.error()
                topic, partition, offset = kafka.record_position(msg)
                assert msg.value() is not None
                messages.append(msg)
                where = (topic, partition)
                if offset + 1 >= remaining.get(where, 0):
                    remaining.pop(where, None)
    finally:
        probe.close()
    assert not remaining, f"could not read up to the end offsets: {remaining}"
    return messages


def read_topics(
    stack_settings, names=INGEST_TOPICS
) -> dict[str, list[tuple[bytes, telemetry_pb2.TelemetryEvent]]]:
    """Everything on the topics, from the beginning, without joining a group."""
    records: dict[str, list] = {t: [] for t in names}
    for msg in read_messages(stack_settings, names):
        event = telemetry_pb2.TelemetryEvent.FromString(msg.value())
        records[msg.topic()].append((msg.key(), event))
    return records
