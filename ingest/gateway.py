"""The transport-independent core of ingest: validate, deduplicate, produce.

Both the HTTP and the gRPC front ends hand their batches to ``Gateway.publish`` and
only translate its per-event results into their own status codes.

Dedup protocol (Redis key ``rtrl:ingest:event:<event_id>``):
  1. claim: ``SET key pending NX EX claim_ttl_s`` — if the key held ``done`` the event
     is a DUPLICATE; if it held ``pending`` another request is writing it: RETRY.
  2. produce to ``topics.BY_PAYLOAD[payload]`` keyed by rollout_id and wait for the ack.
  3. ack: ``SET key done EX dedup_ttl_s`` → ACCEPTED. Produce failure: ``DEL key`` → RETRY,
     so the client's resend is not mistaken for a duplicate.
A gateway that dies between 2 and 3 leaves a pending claim that expires after
``claim_ttl_s``; a resend then writes the event again, which is why every consumer
deduplicates by event_id too (at-least-once here, exactly-once after the consumers).

Privacy-mode events are never produced: an atomic script marks the event_id done and
increments ``rtrl:privacy:<payload>``, so a resend is not counted twice.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from typing import Awaitable, Callable, Protocol, Sequence

import redis.asyncio as aioredis
from confluent_kafka import KafkaException

from ingest.validation import validate
from rtrl import topics
from rtrl.v1 import ingest_pb2, telemetry_pb2

DEDUP_PREFIX = "rtrl:ingest:event:"
PRIVACY_PREFIX = "rtrl:privacy:"

ACCEPTED = ingest_pb2.EventResult.STATUS_ACCEPTED
DUPLICATE = ingest_pb2.EventResult.STATUS_DUPLICATE
REJECTED = ingest_pb2.EventResult.STATUS_REJECTED
RETRY = ingest_pb2.EventResult.STATUS_RETRY

_PENDING = b"pending"
_DONE = b"done"

# KEYS: dedup key, privacy counter; ARGV: dedup ttl. 1 if counted, 0 if seen before.
_PRIVACY_SCRIPT = """
if redis.call('SET', KEYS[1], 'done', 'NX', 'EX', ARGV[1]) then
  redis.call('INCR', KEYS[2])
  return 1
end
return 0
"""


class Producer(Protocol):
    """What the gateway needs from rtrl.kafka.AsyncProducer: a send resolved on broker ack."""

    def send(self, topic: str, value: bytes, key: str, headers: list[tuple[str, bytes]] | None = None) -> Awaitable: ...


@dataclass
class GatewayCounters:
    """Events by outcome since start; reported in the heartbeat."""

    accepted: int = 0
    duplicate: int = 0
    rejected: int = 0
    retry: int = 0
    privacy: int = 0


def dedup_key(event_id: str) -> str:
    return DEDUP_PREFIX + event_id


def privacy_key(payload: str) -> str:
    return PRIVACY_PREFIX + payload


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class Gateway:
    def __init__(
        self,
        producer: Producer,
        redis: aioredis.Redis,
        *,
        dedup_ttl_s: int,
        claim_ttl_s: int,
        max_inflight: int,
        clock_ms: Callable[[], int] = wall_clock_ms,
    ) -> None:
        self._producer = producer
        self._redis = redis
        self._dedup_ttl_s = dedup_ttl_s
        self._claim_ttl_s = claim_ttl_s
        self._max_inflight = max_inflight
        self._clock_ms = clock_ms
        self._privacy = redis.register_script(_PRIVACY_SCRIPT)
        self.inflight = 0
        self.counters = GatewayCounters()

    def status(self) -> dict:
        return {**asdict(self.counters), "inflight": self.inflight}

    async def publish(self, events: Sequence[telemetry_pb2.TelemetryEvent]) -> list[ingest_pb2.EventResult]:
        """One result per event, in order. Good events are written even when others in the
        batch are rejected; only RETRY results are worth sending again."""
        now_ms = self._clock_ms()
        results: list[ingest_pb2.EventResult | None] = [None] * len(events)
        first_seen: dict[str, int] = {}
        repeats: list[tuple[int, int]] = []
        fresh: list[int] = []
        for i, event in enumerate(events):
            rejection = validate(event, now_ms)
            if rejection is not None:
                results[i] = _result(event, REJECTED, rejection.field, rejection.reason)
            elif event.event_id in first_seen:
                repeats.append((i, first_seen[event.event_id]))
            else:
                first_seen[event.event_id] = i
                fresh.append(i)

        admitted = fresh[: max(self._max_inflight - self.inflight, 0)]
        for i in fresh[len(admitted) :]:
            results[i] = _result(events[i], RETRY, "", "gateway busy: too many events awaiting the broker, retry later")
        # Reserve the capacity before the first await so concurrent requests see it.
        self.inflight += len(admitted)
        try:
            outcomes = await self._write([events[i] for i in admitted])
        finally:
            self.inflight -= len(admitted)
        for i, outcome in zip(admitted, outcomes):
            results[i] = outcome
        for i, j in repeats:
            first = results[j]
            status = DUPLICATE if first.status in (ACCEPTED, DUPLICATE) else first.status
            results[i] = _result(events[i], status, first.field, first.error)
        self._count(events, results)
        return results

    async def _write(self, events: list[telemetry_pb2.TelemetryEvent]) -> list[ingest_pb2.EventResult]:
        if not events:
            return []
        async with self._redis.pipeline(transaction=False) as pipe:
            for event in events:
                if event.privacy_mode:
                    await self._privacy(
                        keys=[dedup_key(event.event_id), privacy_key(event.WhichOneof("payload"))],
                        args=[self._dedup_ttl_s],
                        client=pipe,
                    )
                else:
                    pipe.set(dedup_key(event.event_id), _PENDING, nx=True, ex=self._claim_ttl_s, get=True)
            claims = await pipe.execute()

        results: list[ingest_pb2.EventResult | None] = [None] * len(events)
        to_produce: list[int] = []
        for i, (event, claim) in enumerate(zip(events, claims)):
            if event.privacy_mode:
                results[i] = _result(event, ACCEPTED if claim == 1 else DUPLICATE)
            elif claim is None:
                to_produce.append(i)
            elif claim == _DONE:
                results[i] = _result(event, DUPLICATE)
            else:
                results[i] = _result(event, RETRY, "event_id", "another request is writing this event_id, retry later")

        acks = await asyncio.gather(*(self._send(events[i]) for i in to_produce), return_exceptions=True)
        async with self._redis.pipeline(transaction=False) as pipe:
            for i, ack in zip(to_produce, acks):
                if isinstance(ack, (KafkaException, BufferError)):
                    pipe.delete(dedup_key(events[i].event_id))
                    results[i] = _result(events[i], RETRY, "", f"broker did not take the event: {ack}")
                elif isinstance(ack, BaseException):
                    raise ack
                else:
                    pipe.set(dedup_key(events[i].event_id), _DONE, ex=self._dedup_ttl_s)
                    results[i] = _result(events[i], ACCEPTED)
            await pipe.execute()
        return results

    def _send(self, event: telemetry_pb2.TelemetryEvent) -> Awaitable:
        topic = topics.BY_PAYLOAD[event.WhichOneof("payload")]
        # send() enqueues synchronously, in batch order, before anything is awaited,
        # so events of one rollout keep their order on its partition.
        try:
            return self._producer.send(topic, event.SerializeToString(), key=event.rollout_id)
        except BufferError as exc:  # librdkafka's local queue is full
            failed = asyncio.get_running_loop().create_future()
            failed.set_exception(exc)
            return failed

    def _count(self, events: Sequence[telemetry_pb2.TelemetryEvent], results: list[ingest_pb2.EventResult]) -> None:
        for event, result in zip(events, results):
            if result.status == ACCEPTED and event.privacy_mode:
                self.counters.privacy += 1
            elif result.status == ACCEPTED:
                self.counters.accepted += 1
            elif result.status == DUPLICATE:
                self.counters.duplicate += 1
            elif result.status == REJECTED:
                self.counters.rejected += 1
            else:
                self.counters.retry += 1


def _result(event: telemetry_pb2.TelemetryEvent, status: int, field: str = "", error: str = "") -> ingest_pb2.EventResult:
    return ingest_pb2.EventResult(event_id=event.event_id, status=status, field=field, error=error)
