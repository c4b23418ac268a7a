"""Settle events a gateway claimed and then died producing.

Between the broker's ack and marking the event ``done`` in Redis, a killed gateway
leaves an ``rtrl:ingest:inflight`` record and a ``pending`` claim behind. Whether the
event reached Kafka is not knowable from Redis, so the sweep asks Kafka: it reads
every partition of the event's topic from shortly before the claim to the end and
looks for the event_id. Found: the claim becomes ``done`` (a resend is a DUPLICATE).
Not found: the claim is released (a resend is written). Either way the record goes.

Only records older than ``claim_ttl_s`` are swept: by then the owner's produce has
been acknowledged or has failed (claim_ttl_s > produce timeout), so a live owner is
never second-guessed. Reading the topic costs the traffic of the window between the
oldest abandoned claim and now, once per crash.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import redis
from confluent_kafka import Consumer, KafkaError, TopicPartition

from rtrl import kafka, topics
from rtrl.config import StackSettings
from rtrl.ingest.gateway import INFLIGHT, PAYLOADS
from rtrl_client.v1 import telemetry_pb2

log = logging.getLogger("rtrl.ingest.recovery")

# Tansu's timestamp index is approximate: start this much before the oldest claim.
LOOKBACK_MS = 5_000
# A sweep that cannot read its window by then fails; the next sweep tries again (and
# resends of the events in question keep getting RETRY meanwhile, never a duplicate).
READ_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Sweep:
    landed: int
    """Abandoned events found on their topic: marked done."""
    released: int
    """Abandoned events not on their topic: claim released for the resend."""


def sweep(
    stack: StackSettings,
    redis_url: str,
    *,
    older_than_ms: int,
    dedup_ttl_s: int,
    now_ms: int | None = None,
) -> Sweep:
    """Settle every in-flight record claimed before ``now - older_than_ms``. Blocking."""
    now_ms = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    client = redis.Redis.from_url(redis_url)
    try:
        abandoned: dict[str, tuple[int, str]] = {}
        for field, value in client.hgetall(INFLIGHT).items():
            claimed_ms, kind = _text(value).split("|")
            if int(claimed_ms) <= now_ms - older_than_ms:
                abandoned[_text(field)] = (
                    int(claimed_ms),
                    topics.BY_PAYLOAD[PAYLOADS[int(kind) - 1]],
                )
        if not abandoned:
            return Sweep(0, 0)
        since = min(claimed for claimed, _ in abandoned.values()) - LOOKBACK_MS
        wanted = {key.rsplit(":", 1)[1]: key for key in abandoned}
        found = _event_ids_on(
            stack, sorted({topic for _, topic in abandoned.values()}), since, set(wanted)
        )
        with client.pipeline(transaction=False) as pipe:
            for event_id, key in wanted.items():
                if event_id in found:
                    pipe.set(key, b"done", ex=dedup_ttl_s)
                else:
                    pipe.delete(key)
                pipe.hdel(INFLIGHT, key)
            pipe.execute()
        result = Sweep(landed=len(found), released=len(wanted) - len(found))
        log.warning(
            "settled %d events abandoned mid-produce: %d had landed, %d released for resend",
            len(wanted),
            result.landed,
            result.released,
        )
        return result
    finally:
        client.close()


def _event_ids_on(
    stack: StackSettings, names: list[str], since_ms: int, wanted: set[str]
) -> set[str]:
    """Which of ``wanted`` are on the topics at or after ``since_ms``."""
    consumer = Consumer(
        kafka.consumer_config(stack, "rtrl-ingest-recovery", **{"enable.partition.eof": True})
    )
    try:
        tps = kafka.partitions(stack, tuple(names))
        ends = kafka.end_offsets(stack, tps)
        starts = consumer.offsets_for_times(
            [TopicPartition(tp.topic, tp.partition, since_ms) for tp in tps], timeout=10
        )
        assign = []
        for tp in starts:
            end = ends[(tp.topic, tp.partition)]
            start = end if tp.offset < 0 else tp.offset
            if start < end:
                assign.append(TopicPartition(tp.topic, tp.partition, start))
        remaining = {(tp.topic, tp.partition): ends[(tp.topic, tp.partition)] for tp in assign}
        found: set[str] = set()
        if not assign:
            return found
        consumer.assign(assign)
        deadline = time.monotonic() + READ_TIMEOUT_S
        while remaining:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"recovery could not read to the end of {remaining} within {READ_TIMEOUT_S} s"
                )
            for message in consumer.consume(1000, timeout=1.0):
                error = message.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        topic, partition, _ = kafka.record_position(message)
                        remaining.pop((topic, partition), None)
                    continue
                topic, partition, offset = kafka.record_position(message)
                value = message.value()
                if value is None:
                    raise ValueError(
                        f"record {topic}:{partition}:{offset} has no value; the gateway writes none such"
                    )
                event_id = telemetry_pb2.TelemetryEvent.FromString(value).event_id
                if event_id in wanted:
                    found.add(event_id)
                if offset + 1 >= remaining.get((topic, partition), 0):
                    remaining.pop((topic, partition), None)
        return found
    finally:
        consumer.close()


def _text(reply: bytes | str) -> str:
    """A Redis reply as text (this client returns bytes; redis-py's types allow either)."""
    return reply.decode() if isinstance(reply, bytes) else reply
