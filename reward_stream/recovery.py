"""What a partition already settled, read back from the joiner's own outputs.

The joiner keeps no state of its own on disk: the reward topic and the .late topic
are its log. Both are keyed by rollout_id with the input topics' partition count,
so partition p of each holds the outputs of input partition p. Reading them back to
their end tells a restarted (or newly assigned) worker which rollouts settled and
which events they consumed; records it reads again for those rollouts are then
duplicates, not second rewards (see runtime.py).
"""

from __future__ import annotations

import time

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from google.protobuf.message import DecodeError

from rtrl import kafka, topics
from rtrl.config import StackSettings
from rtrl.v1 import reward_pb2, rollout_pb2
from rtrl_client.v1 import telemetry_pb2


def settled_rollouts(
    stack: StackSettings, partition: int, timeout_s: float = 30.0
) -> dict[str, frozenset[str]]:
    """rollout_id -> ids of the events already consumed for it, from partition's rewards and late records."""
    tps = [TopicPartition(topics.REWARD, partition), TopicPartition(topics.REWARD_LATE, partition)]
    ends = kafka.end_offsets(stack, tps)
    waiting = {(tp.topic, tp.partition) for tp in tps if ends[(tp.topic, tp.partition)] > 0}
    settled: dict[str, set[str]] = {}
    if not waiting:
        return {}
    reader = Consumer(
        kafka.client_config(
            stack,
            **{
                "group.id": "rtrl-reward-recovery",
                "enable.auto.commit": False,
                **kafka.PROBE_FETCH,
            },
        )
    )
    try:
        reader.assign(
            [
                TopicPartition(tp.topic, tp.partition, OFFSET_BEGINNING)
                for tp in tps
                if (tp.topic, tp.partition) in waiting
            ]
        )
        deadline = time.monotonic() + timeout_s
        while waiting:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"reading back partition {partition} of {sorted(t for t, _ in waiting)} took over {timeout_s} s"
                )
            for message in reader.consume(1000, timeout=0.02):
                if message.error() is not None:
                    continue
                topic, partition, offset = kafka.record_position(message)
                value = message.value()
                if value is None:
                    raise ValueError(
                        f"record {topic}:{partition}:{offset} has no value; the joiner writes none such"
                    )
                _remember(settled, topic, value, dict(kafka.record_headers(message)))
                if offset + 1 >= ends[(topic, partition)]:
                    waiting.discard((topic, partition))
    finally:
        reader.close()
    return {rollout_id: frozenset(event_ids) for rollout_id, event_ids in settled.items()}


def _remember(
    settled: dict[str, set[str]], topic: str, value: bytes, headers: dict[str, bytes | None]
) -> None:
    try:
        if topic == topics.REWARD:
            record = reward_pb2.RewardRecord.FromString(value)
            settled.setdefault(record.rollout_id, set()).update(record.event_ids)
        elif headers.get("kind") == b"rollout":
            rollout = rollout_pb2.RolloutRecord.FromString(value)
            settled.setdefault(rollout.rollout_id, set()).add(rollout.event_id)
        else:
            event = telemetry_pb2.TelemetryEvent.FromString(value)
            settled.setdefault(event.rollout_id, set()).add(event.event_id)
    except DecodeError:
        # Only this service writes these topics; a record it cannot read changes nothing it must know.
        return


def input_positions(
    stack: StackSettings, group: str, partition: int, timeout_s: float = 10.0
) -> dict[str, tuple[int, int]]:
    """Input topic -> (offset ``group`` resumes partition at, the partition's end offset).

    The resume point is the committed offset, or the log start when nothing is
    committed (the joiner reads from the earliest record then). What lies in between
    is the backlog the join must read before trusting the wall clock (join.py)."""
    tps = [TopicPartition(topic, partition) for topic in topics.TELEMETRY]
    ends = kafka.end_offsets(stack, tps, timeout_s)
    reader = Consumer(
        kafka.client_config(stack, **{"group.id": group, "enable.auto.commit": False})
    )
    try:
        committed = reader.committed(tps, timeout=timeout_s)
        positions = {}
        for tp in committed:
            start = tp.offset
            if start < 0:
                start, _ = reader.get_watermark_offsets(
                    TopicPartition(tp.topic, partition), timeout=timeout_s, cached=False
                )
            positions[tp.topic] = (start, ends[(tp.topic, partition)])
        return positions
    finally:
        reader.close()
