"""The transport-independent core of ingest: validate, deduplicate, produce.

Both the HTTP and the gRPC front ends (ingest/http_api.py, ingest/grpc_api.py) admit the
request (rtrl/admission.py, ``batch_refusal``) and hand its batch to ``Gateway.publish``;
they only translate its per-event results into their own status codes.

Dedup protocol (Redis key ``rtrl:ingest:event:<event_id>``), one script call per batch:
  1. claim: ``SET key pending NX GET EX claim_ttl_s`` — if the key held ``done`` the
     event is a DUPLICATE; if it held ``pending`` another request is writing it: RETRY.
  2. produce to ``topics.BY_PAYLOAD[payload]`` keyed by rollout_id and wait for the acks.
  3. ack: ``SET key done EX dedup_ttl_s`` → ACCEPTED. Produce failure: ``DEL key`` → RETRY,
     so the client's resend is not mistaken for a duplicate.
Each claimed event is also recorded in the ``rtrl:ingest:inflight`` hash until step 3
ends. A gateway that dies between 2 and 3 leaves that record behind: a resend gets
RETRY (even after the claim's TTL) until a recovery sweep (ingest/recovery.py), run
by every gateway at start and every ``claim_ttl_s``, reads the topic and either marks
the event done (it landed) or releases it (it did not). So no event is written twice
even across a kill -9; every consumer still deduplicates by event_id as well.

Privacy: an event flagged ``privacy_mode`` by the client, or from a user in the
``rtrl:ingest:private-users`` set, is never produced. The same script marks its event_id
done and increments ``rtrl:privacy:<payload>``, so a resend is not counted twice.

Trace context: each batch is one ``ingest publish`` span (a child of the client's
``traceparent``, if it sent one), and every record carries the span's W3C
``traceparent`` in its Kafka headers (the client's own when no SDK records spans).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

import redis.asyncio as aioredis
from opentelemetry import trace

from rtrl import heartbeat, kafka, otel, signing, topics
from rtrl.admission import Admission, Refusal
from rtrl.api_keys import PRIVATE_USERS, SERVED_PREFIX, ApiKey
from rtrl.event_time import EventTimeWindow
from rtrl.ingest.sdk_counts import SdkCounts
from rtrl.ingest.validation import CLIENT_TS_WINDOW, validate
from rtrl_client.v1 import ingest_pb2, telemetry_pb2

DEDUP_PREFIX = "rtrl:ingest:event:"
PRIVACY_PREFIX = "rtrl:privacy:"

ACCEPTED = ingest_pb2.EventResult.STATUS_ACCEPTED
DUPLICATE = ingest_pb2.EventResult.STATUS_DUPLICATE
REJECTED = ingest_pb2.EventResult.STATUS_REJECTED
RETRY = ingest_pb2.EventResult.STATUS_RETRY

_PENDING = b"pending"
PAYLOADS = ("edit_shown", "edit_outcome", "persistence", "followup")
_PAYLOAD_DIGIT = {payload: str(i) for i, payload in enumerate(PAYLOADS, start=1)}
"""The claim script's one-digit index of each payload (its privacy counter's place in KEYS)."""

# What the claim script answers per event.
CLAIMED, SEEN, BEING_WRITTEN, PRIVATE_COUNTED, PRIVATE_SEEN = range(5)

INFLIGHT = "rtrl:ingest:inflight"
"""Hash: dedup key -> "<claim ms>|<payload index>" of every event being produced. It
outlives the claim's TTL, so a gateway killed mid-produce leaves a record that the
recovery sweep (ingest/recovery.py) settles by reading the topic."""

# KEYS: n dedup keys, the private-users set, the privacy counters in PAYLOADS order, INFLIGHT.
# ARGV: claim ttl, dedup ttl, now ms, then per event one argument: flagged (0/1), payload index
# (1-based, one digit), user_id, e.g. "02alice" (one argument, not three: packing the script's
# arguments is a gateway cost per event).
_CLAIM_SCRIPT = """
local n = #KEYS - 1 - 4 - 1
local inflight = KEYS[#KEYS]
local out = {}
for i = 1, n do
  local event = ARGV[3 + i]
  local flagged, kind, user = string.sub(event, 1, 1), tonumber(string.sub(event, 2, 2)), string.sub(event, 3)
  if flagged == '1' or redis.call('SISMEMBER', KEYS[n + 1], user) == 1 then
    if redis.call('SET', KEYS[i], 'done', 'NX', 'EX', ARGV[2]) then
      redis.call('INCR', KEYS[n + 1 + kind])
      out[i] = 3
    else
      out[i] = 4
    end
  elseif redis.call('HEXISTS', inflight, KEYS[i]) == 1 then
    out[i] = 2
  else
    local previous = redis.call('SET', KEYS[i], 'pending', 'NX', 'GET', 'EX', ARGV[1])
    if not previous then
      redis.call('HSET', inflight, KEYS[i], ARGV[3] .. '|' .. kind)
      out[i] = 0
    elseif previous == 'done' then
      out[i] = 1
    else
      out[i] = 2
    end
  end
end
return out
"""

# After the produce: each claimed event marked done (its dedup key kept for the dedup TTL) or
# released for a resend (key deleted), and its in-flight entry removed: one call for the
# batch, where a pipeline of one command per event cost the gateway a fifth of its time.
# KEYS: n dedup keys, INFLIGHT. ARGV: dedup ttl, then per event 1 (written) or 0 (not).
_SETTLE_SCRIPT = """
local n = #KEYS - 1
for i = 1, n do
  if ARGV[i + 1] == '1' then
    redis.call('SET', KEYS[i], 'done', 'EX', ARGV[1])
  else
    redis.call('DEL', KEYS[i])
  end
  redis.call('HDEL', KEYS[n + 1], KEYS[i])
end
return n
"""

_tracer = trace.get_tracer("rtrl.ingest")
_UNSERVED = ((kafka.UNSERVED_HEADER, b"1"),)


class Producer(Protocol):
    """What the gateway needs from rtrl.kafka.AsyncProducer: a batch send resolved once
    the broker has acknowledged (or failed) every record."""

    def send_batch(
        self, records: list[tuple[str, bytes, str, list[tuple[str, bytes]]]]
    ) -> Awaitable[list[BaseException | None]]: ...


@dataclass
class GatewayCounters:
    """Events by outcome since start; reported in the heartbeat."""

    accepted: int = 0
    duplicate: int = 0
    rejected: int = 0
    retry: int = 0
    privacy: int = 0
    """Privacy-mode events counted (never published)."""


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
        signer: signing.Seal,
        clock_ms: Callable[[], int] = wall_clock_ms,
        client_ts_window: EventTimeWindow = CLIENT_TS_WINDOW,
    ) -> None:
        self._producer = producer
        self._signer = signer
        """Authenticates every event written (the joiner joins only events that verify)."""
        self._redis = redis
        self._dedup_ttl_s = dedup_ttl_s
        self._claim_ttl_s = claim_ttl_s
        self._max_inflight = max_inflight
        self._clock_ms = clock_ms
        self._client_ts_window = client_ts_window
        self._claim = redis.register_script(_CLAIM_SCRIPT)
        self._settle = redis.register_script(_SETTLE_SCRIPT)
        self.inflight = 0
        self.counters = GatewayCounters()
        self.by_sdk = SdkCounts()
        """The same answers by the SDK (name and version) that sent them."""

    def status(self) -> heartbeat.IngestBeat:
        return heartbeat.IngestBeat(**asdict(self.counters), inflight=self.inflight)

    async def publish(
        self,
        events: Sequence[telemetry_pb2.TelemetryEvent],
        *,
        key: ApiKey | None = None,
        traceparent: str = "",
        sdk: str = "",
    ) -> list[ingest_pb2.EventResult]:
        """One result per event, in order. Good events are written even when others in the
        batch are rejected; only RETRY results are worth sending again. ``key`` limits
        the event types (None: the gateway runs without authentication); ``sdk`` is the
        request's ``X-Rtrl-Sdk`` (ingest/sdk_counts.py), counted, never trusted."""
        with _tracer.start_as_current_span(
            "ingest publish", context=otel.parent(traceparent), kind=trace.SpanKind.PRODUCER
        ) as span:
            span.set_attributes(
                {
                    "messaging.system": "kafka",
                    "messaging.operation.type": "publish",
                    "messaging.batch.message_count": len(events),
                }
            )
            if key is not None:
                span.set_attribute("rtrl.client_id", key.client_id)
            headers = kafka.traceparent_headers(otel.traceparent_of(span) or traceparent)
            results = await self._publish(events, key, headers)
            self.by_sdk.count(sdk, results)
            return results

    async def _publish(
        self,
        events: Sequence[telemetry_pb2.TelemetryEvent],
        key: ApiKey | None,
        headers: list[tuple[str, bytes]],
    ) -> list[ingest_pb2.EventResult]:
        now_ms = self._clock_ms()
        results: list[ingest_pb2.EventResult | None] = [None] * len(events)
        first_seen: dict[str, int] = {}
        repeats: list[tuple[int, int]] = []
        fresh: list[int] = []
        served_to = await self._served_to(events) if key is not None else [None] * len(events)
        for i, event in enumerate(events):
            # Who sent it is the key's to say, never the client's.
            event.client_id = key.client_id if key is not None else ""
            results[i] = self._rejection(event, key, served_to[i], now_ms)
            if results[i] is not None:
                continue
            if event.event_id in first_seen:
                repeats.append((i, first_seen[event.event_id]))
            else:
                first_seen[event.event_id] = i
                fresh.append(i)
        # Events about a rollout no worker served (the serving API marks each before its
        # answer) are stamped so: the joiner drops them when their window closes
        # (kafka.UNSERVED_HEADER).
        unserved = frozenset(
            event.rollout_id
            for event, client in zip(events, served_to, strict=True)
            if key is not None and client is None
        )
        await self._write_admitted(events, fresh, results, headers, unserved)
        for i, j in repeats:
            first = results[j]
            assert first is not None  # j is fresh, and every fresh event has its result by now
            status = DUPLICATE if first.status in (ACCEPTED, DUPLICATE) else first.status
            results[i] = _result(events[i], status, first.field, first.error)
        answered = _answered(results)
        self._count(events, answered)
        return answered

    def _rejection(
        self,
        event: telemetry_pb2.TelemetryEvent,
        key: ApiKey | None,
        served_to: str | None,
        now_ms: int,
    ) -> ingest_pb2.EventResult | None:
        """REJECTED when the event is invalid, of a type its key may not send, or about a
        rollout served to another client; None when it may be written."""
        rejection = validate(event, now_ms, self._client_ts_window)
        if rejection is not None:
            return _result(event, REJECTED, rejection.field, rejection.reason)
        if key is None:
            return None
        if not key.allows(event.WhichOneof("payload")):
            return _result(
                event,
                REJECTED,
                "payload",
                f"the API key of client {key.client_id!r} may not send {event.WhichOneof('payload')} events",
            )
        if served_to is not None and served_to != key.client_id:
            return _result(
                event,
                REJECTED,
                "rollout_id",
                f"rollout {event.rollout_id} was served to another client's API key",
            )
        return None

    async def _write_admitted(
        self,
        events: Sequence[telemetry_pb2.TelemetryEvent],
        fresh: list[int],
        results: list[ingest_pb2.EventResult | None],
        headers: list[tuple[str, bytes]],
        unserved: frozenset[str] = frozenset(),
    ) -> None:
        """Writes the fresh events the in-flight budget admits and answers RETRY to the rest,
        filling ``results`` at their indices. Events about a rollout in ``unserved`` are
        written with kafka.UNSERVED_HEADER."""
        admitted = fresh[: max(self._max_inflight - self.inflight, 0)]
        for i in fresh[len(admitted) :]:
            results[i] = _result(
                events[i],
                RETRY,
                "",
                "gateway busy: too many events awaiting the broker, retry later",
            )
        # Reserve the capacity before the first await so concurrent requests see it.
        self.inflight += len(admitted)
        try:
            outcomes = await self._write([events[i] for i in admitted], headers, unserved)
        finally:
            self.inflight -= len(admitted)
        for i, outcome in zip(admitted, outcomes, strict=True):
            results[i] = outcome

    async def _served_to(self, events: Sequence[telemetry_pb2.TelemetryEvent]) -> list[str | None]:
        """The client each event's rollout was served to, where the serving API recorded one."""
        if not events:
            return []
        found = await self._redis.mget([SERVED_PREFIX + event.rollout_id for event in events])
        return [value.decode() if isinstance(value, bytes) else value for value in found]

    async def _write(
        self,
        events: list[telemetry_pb2.TelemetryEvent],
        headers: list[tuple[str, bytes]],
        unserved: frozenset[str] = frozenset(),
    ) -> list[ingest_pb2.EventResult]:
        if not events:
            return []
        claims = await self._claim_all(events)
        results: list[ingest_pb2.EventResult | None] = [None] * len(events)
        to_produce: list[int] = []
        for i, (event, claim) in enumerate(zip(events, claims, strict=True)):
            if claim == CLAIMED:
                to_produce.append(i)
            elif claim in (SEEN, PRIVATE_SEEN):
                results[i] = _result(event, DUPLICATE)
            elif claim == PRIVATE_COUNTED:
                # ACCEPTED for the client (it must not resend); counted apart from published events.
                results[i] = _result(event, ACCEPTED)
                self.counters.privacy += 1
                self.counters.accepted -= 1
            else:
                results[i] = _result(
                    event,
                    RETRY,
                    "event_id",
                    "another request is writing this event_id, retry later",
                )
        if to_produce:
            await self._produce(events, to_produce, results, headers, unserved)
        return _answered(results)

    async def _claim_all(self, events: list[telemetry_pb2.TelemetryEvent]) -> list[int]:
        """The claim script's answer per event (CLAIMED, SEEN, ...), in one call."""
        keys = [dedup_key(event.event_id) for event in events]
        keys.append(PRIVATE_USERS)
        keys.extend(privacy_key(payload) for payload in PAYLOADS)
        keys.append(INFLIGHT)
        args: list[str | int] = [self._claim_ttl_s, self._dedup_ttl_s, self._clock_ms()]
        args.extend(
            f"{1 if event.privacy_mode else 0}{_PAYLOAD_DIGIT[event.WhichOneof('payload')]}{event.user_id}"
            for event in events
        )
        return await self._claim(keys=keys, args=args)

    async def _produce(
        self,
        events: list[telemetry_pb2.TelemetryEvent],
        to_produce: list[int],
        results: list[ingest_pb2.EventResult | None],
        headers: list[tuple[str, bytes]],
        unserved: frozenset[str] = frozenset(),
    ) -> None:
        """Produces the claimed events, then marks each done (ACCEPTED) or releases its
        claim (RETRY), filling ``results`` at their indices."""
        # send_batch enqueues in batch order before anything is awaited, so events of
        # one rollout keep their order on its partition.
        records = []
        for i in to_produce:
            value = events[i].SerializeToString()
            records.append(
                (
                    topics.BY_PAYLOAD[events[i].WhichOneof("payload")],
                    value,
                    events[i].rollout_id,
                    [
                        *headers,
                        *(_UNSERVED if events[i].rollout_id in unserved else ()),
                        *self._signer.headers(value),
                    ],
                )
            )
        errors = await self._producer.send_batch(records)
        written: list[int | str] = [self._dedup_ttl_s]
        for i, error in zip(to_produce, errors, strict=True):
            if error is not None:
                results[i] = _result(
                    events[i], RETRY, "", f"broker did not take the event: {error}"
                )
            else:
                results[i] = _result(events[i], ACCEPTED)
            written.append(0 if error is not None else 1)
        keys = [dedup_key(events[i].event_id) for i in to_produce]
        await self._settle(keys=[*keys, INFLIGHT], args=written)

    def _count(
        self, events: Sequence[telemetry_pb2.TelemetryEvent], results: list[ingest_pb2.EventResult]
    ) -> None:
        for result in results:
            if result.status == ACCEPTED:
                self.counters.accepted += 1
            elif result.status == DUPLICATE:
                self.counters.duplicate += 1
            elif result.status == REJECTED:
                self.counters.rejected += 1
            else:
                self.counters.retry += 1


async def batch_refusal(
    admission: Admission, key: ApiKey | None, events: Sequence[telemetry_pb2.TelemetryEvent]
) -> Refusal | None:
    """May this key send this batch now: 403 when it may send none of the batch's event
    types (``Gateway.publish`` rejects the others one by one), 429 when its events per
    second, or its event bytes per second, are spent. Both front ends ask this once the
    batch is parsed."""
    kinds = {kind for event in events if (kind := event.WhichOneof("payload")) is not None}
    refusal = admission.scope_refusal(key, kinds)
    if refusal is not None:
        return refusal
    refusal = await admission.rate_refusal(key, len(events), "events")
    if refusal is not None or key is None:
        return refusal
    return await admission.byte_refusal(key, sum(event.ByteSize() for event in events))


def _answered(results: list[ingest_pb2.EventResult | None]) -> list[ingest_pb2.EventResult]:
    """``results`` once every event has its result (each path through the caller sets one)."""
    answered = [result for result in results if result is not None]
    assert len(answered) == len(results), "an event was left without a result"
    return answered


def _result(
    event: telemetry_pb2.TelemetryEvent,
    status: ingest_pb2.EventResult.Status,
    field: str = "",
    error: str = "",
) -> ingest_pb2.EventResult:
    if not (field or error):  # most results: empty strings cost a third of making one
        return ingest_pb2.EventResult(event_id=event.event_id, status=status)
    return ingest_pb2.EventResult(event_id=event.event_id, status=status, field=field, error=error)
