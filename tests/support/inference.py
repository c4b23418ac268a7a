"""What the inference workers wrote to the rollout topic, read back; shared by the
inference worker's tests and the SGLang backend's."""

from __future__ import annotations

import time

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from rtrl import kafka, topics
from rtrl.v1 import rollout_pb2


def read_rollouts(settings, timeout_s: float = 10.0) -> list[rollout_pb2.RolloutRecord]:
    """Every record on the rollout topic (the count comes from the end offsets)."""
    tps = [TopicPartition(topics.ROLLOUT, p) for p in range(settings.kafka_partitions)]
    expected = sum(kafka.end_offsets(settings, tps).values())
    consumer = Consumer(kafka.consumer_config(settings, "test-inference"))
    consumer.assign(
        [
            TopicPartition(topics.ROLLOUT, p, OFFSET_BEGINNING)
            for p in range(settings.kafka_partitions)
        ]
    )
    records: list[rollout_pb2.RolloutRecord] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(records) < expected and time.monotonic() < deadline:
            for msg in consumer.consume(100, timeout=0.2):
                if msg.error() is None:
                    key, value = msg.key(), msg.value()
                    assert key is not None and value is not None
                    record = rollout_pb2.RolloutRecord.FromString(value)
                    assert key.decode() == record.rollout_id
                    records.append(record)
    finally:
        consumer.close()
    assert len(records) == expected
    return records
