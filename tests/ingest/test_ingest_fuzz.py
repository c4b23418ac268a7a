"""Both ingest front ends under fuzzing (hypothesis), one real gateway (Tansu + Redis) per test.

The contract (ingest/server.py): a request that is not a PublishEventsRequest is refused
whole with the reason (HTTP 400 ``{"error": ...}``, gRPC INVALID_ARGUMENT); in one that
is, every bad event is REJECTED naming its field while the good events beside it are
ACCEPTED (DUPLICATE when sent again) and land on their topic exactly once.

A ``Ledger`` is the oracle: it predicts every answer, records what the gateway said, and
at the end the topics and the gateway's counters must agree with it. Malformed payloads
sent, each test asserting its share of 10,000: at least 4,000 malformed requests (or bad
events inside the few that still parse) and 6,000 bad events among good ones.
"""

from __future__ import annotations

import asyncio
import gc
import gzip
import json
import math
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import grpc
import pytest
import redis.asyncio as aioredis
from google.protobuf import json_format
from google.protobuf.internal import encoder
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rtrl import topics
from rtrl.api_keys import issue_key
from rtrl.ingest.config import IngestSettings
from rtrl.ingest.gateway import ACCEPTED, DUPLICATE, REJECTED
from rtrl.ingest.server import start
from rtrl.ingest.validation import MAX_PATH_BYTES, MAX_TEXT_BYTES, validate
from rtrl.procs import free_port
from rtrl_client.v1 import ingest_pb2, telemetry_pb2
from support.ingest import read_topics
from support.signing import KEY_AUTHORITY

pytestmark = pytest.mark.integration

MAX_BATCH = 100
MAX_BODY_BYTES = 4 * 1024 * 1024
DAY_MS = 24 * 3600 * 1000
PAYLOADS = ("edit_shown", "edit_outcome", "persistence", "followup")
# The order in which validation looks at the envelope: an event with several faults is
# rejected for the first.
ENVELOPE = ("event_id", "rollout_id", "session_id", "user_id", "schema_version", "client_ts_ms")


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


# ---- the gateway, driven from synchronous hypothesis code ----


@dataclass(frozen=True)
class HttpAnswer:
    status: int
    content_type: str
    text: str


@dataclass(frozen=True)
class GrpcAnswer:
    code: grpc.StatusCode
    details: str
    trailing: tuple
    response: ingest_pb2.PublishEventsResponse | None


class Front:
    """Both front ends of one running gateway. Each call runs the event loop, and so the
    gateway in it, until the answer is in."""

    def __init__(self, loop: asyncio.AbstractEventLoop, settings: IngestSettings) -> None:
        self.loop = loop
        self.settings = settings
        self.api_key = ""
        self._http: aiohttp.ClientSession | None = None
        self._channel: grpc.aio.Channel | None = None

    async def open(self, redis_url: str) -> None:
        client = aioredis.Redis.from_url(redis_url)
        try:
            self.api_key = await issue_key(client, KEY_AUTHORITY, "fuzz-client")
        finally:
            await client.aclose()
        self._http = aiohttp.ClientSession()
        self._channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.settings.grpc_port}")
        # No serializer: the request is sent as the bytes given, malformed or not.
        self._publish = self._channel.unary_unary(
            "/rtrl.v1.Ingest/PublishEvents",
            request_serializer=None,
            response_deserializer=ingest_pb2.PublishEventsResponse.FromString,
        )

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
        if self._channel is not None:
            await self._channel.close()

    def http(self, body: bytes, authorization: str | None = None) -> HttpAnswer:
        async def post() -> HttpAnswer:
            assert self._http is not None, "not started"
            headers = {
                "Content-Type": "application/json",
                "Authorization": self._authorization(authorization),
            }
            async with self._http.post(
                f"http://127.0.0.1:{self.settings.http_port}/v1/events", data=body, headers=headers
            ) as r:
                return HttpAnswer(
                    r.status, r.content_type, (await r.read()).decode("utf-8", "replace")
                )

        return self.loop.run_until_complete(post())

    def raw_http(self, request: bytes) -> HttpAnswer:
        """One request written byte for byte, for what aiohttp's client would not send."""

        async def exchange() -> HttpAnswer:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.settings.http_port)
            try:
                writer.write(request)
                await writer.drain()
                head, _, body = (await asyncio.wait_for(reader.read(), 10)).partition(b"\r\n\r\n")
            finally:
                writer.close()
            lines = head.decode("latin-1").split("\r\n")
            fields = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
            content_type = fields.get("content-type", "").split(";")[0]
            return HttpAnswer(
                int(lines[0].split()[1]), content_type, body.decode("utf-8", "replace")
            )

        return self.loop.run_until_complete(exchange())

    def grpc(self, raw: bytes, authorization: str | None = None) -> GrpcAnswer:
        async def call() -> GrpcAnswer:
            metadata = (("authorization", self._authorization(authorization)),)
            try:
                response = await self._publish(raw, metadata=metadata, timeout=30)
            except grpc.aio.AioRpcError as exc:
                return GrpcAnswer(
                    exc.code(), exc.details() or "", tuple(exc.trailing_metadata() or ()), None
                )
            return GrpcAnswer(grpc.StatusCode.OK, "", (), response)

        return self.loop.run_until_complete(call())

    def _authorization(self, given: str | None) -> str:
        return f"Bearer {self.api_key}" if given is None else given

    def health(self) -> tuple[int, dict]:
        async def get() -> tuple[int, dict]:
            assert self._http is not None, "not started"
            async with self._http.get(f"http://127.0.0.1:{self.settings.http_port}/healthz") as r:
                return r.status, await r.json()

        return self.loop.run_until_complete(get())


@pytest.fixture
def front(stack_settings):
    loop = asyncio.new_event_loop()
    ingest = IngestSettings(
        http_port=free_port(),
        grpc_port=free_port(),
        max_batch=MAX_BATCH,
        max_body_bytes=MAX_BODY_BYTES,
    )
    server = loop.run_until_complete(start(stack_settings, ingest))
    handle = Front(loop, ingest)
    try:
        loop.run_until_complete(handle.open(stack_settings.redis_url))
        yield handle
    finally:
        loop.run_until_complete(handle.close())
        loop.run_until_complete(server.stop())
        loop.close()
        # The closed producer's broker connection goes with the server's reference cycles;
        # Tansu waits for open connections when the fixture stops it.
        gc.collect()


# Examples are whole requests to a live gateway: slow to run, large, and not replayable
# from a database (the gateway has moved on).
SLOW_AND_LARGE = [
    HealthCheck.too_slow,
    HealthCheck.data_too_large,
    HealthCheck.filter_too_much,
    HealthCheck.large_base_example,
]


def fuzz(strategy: st.SearchStrategy, examples: int, check) -> None:
    """Run ``check`` on ``examples`` values of ``strategy``, against the gateway already running."""

    @settings(
        max_examples=examples, deadline=None, database=None, suppress_health_check=SLOW_AND_LARGE
    )
    @given(strategy)
    def run(value) -> None:
        check(value)

    run()


# ---- the oracle ----


@dataclass
class Ledger:
    """What the gateway said it did with every event sent, and what it must have done."""

    published: dict[str, telemetry_pb2.TelemetryEvent] = field(default_factory=dict)
    """ACCEPTED outside privacy mode: on its topic exactly once."""
    private: set[str] = field(default_factory=set)
    """ACCEPTED in privacy mode: counted, on no topic."""
    accepted: list[telemetry_pb2.TelemetryEvent] = field(default_factory=list)
    unpublished: set[str] = field(default_factory=set)
    """Ids of rejected events and of events in refused requests: on no topic (unless a
    good event with the same id was accepted)."""
    answered: Counter = field(default_factory=Counter)
    """Per-event outcomes as the gateway's counters name them."""
    malformed: Counter = field(default_factory=Counter)
    """Malformed payloads sent, by (front end, kind)."""

    def due(self, events, faults: list[str | None]) -> list[tuple[int, str]]:
        """The (status, field) each event must get; ``faults[i]`` is the field at fault in events[i]."""
        taken = set(self.published) | self.private
        out: list[tuple[int, str]] = []
        for event, fault in zip(events, faults, strict=True):
            if fault is not None:
                out.append((REJECTED, fault))
            elif event.event_id in taken:
                out.append((DUPLICATE, ""))
            else:
                taken.add(event.event_id)
                out.append((ACCEPTED, ""))
        return out

    def record(self, events, statuses: list[int]) -> None:
        for event, status in zip(events, statuses, strict=True):
            if status == ACCEPTED:
                if event.privacy_mode:
                    self.answered["privacy"] += 1
                    self.private.add(event.event_id)
                else:
                    self.answered["accepted"] += 1
                    self.published[event.event_id] = event
                self.accepted.append(event)
            elif status == DUPLICATE:
                self.answered["duplicate"] += 1
            else:
                self.answered["rejected" if status == REJECTED else "retry"] += 1
                self.unpublished.add(event.event_id)

    def refused(self, events) -> None:
        self.unpublished.update(event.event_id for event in events)


def faults_at_gateway_clock(events) -> list[str | None]:
    """The field validation will fault in each event, whenever in the next 2 s the gateway
    reads its clock; an example on a boundary of the time window is not sent."""
    now = wall_ms()
    faults: list[str | None] = []
    for event in events:
        early, late = validate(event, now), validate(event, now + 2_000)
        assume((early and early.field) == (late and late.field))
        faults.append(early.field if early is not None else None)
    return faults


def json_mapping(body: bytes) -> ingest_pb2.PublishEventsRequest | None:
    """The request ``body`` is the JSON form of, or None. protobuf's own parser is the
    reference, except that it also reads a top-level array or string as an empty request."""
    try:
        text = body.decode("utf-8")
        if not isinstance(json.loads(text), dict):
            return None
        return json_format.Parse(text, ingest_pb2.PublishEventsRequest())
    except (ValueError, RecursionError, json_format.ParseError):
        return None


def check_http_events(
    ledger: Ledger, answer: HttpAnswer, events, faults: list[str | None], kind: str
) -> None:
    """A parsed batch: one result per event, the HTTP status the docstring gives for them."""
    due = ledger.due(events, faults)
    rejected = sum(s == REJECTED for s, _ in due)
    assert answer.status == (200 if rejected == 0 else 400 if rejected == len(due) else 207), answer
    results = json_format.Parse(answer.text, ingest_pb2.PublishEventsResponse()).results
    assert len(results) == len(events), answer.text[:2000]
    ledger.record(events, [r.status for r in results])
    assert [(r.status, r.field) for r in results] == due, answer.text[:2000]
    assert [r.event_id for r in results] == [e.event_id for e in events]
    assert all(r.error for r in results if r.status == REJECTED)
    ledger.malformed["http", kind] += rejected


def check_grpc_events(
    ledger: Ledger, answer: GrpcAnswer, events, faults: list[str | None], kind: str
) -> None:
    """A parsed batch: OK with one result per event, or INVALID_ARGUMENT naming every
    event's field when none is good."""
    due = ledger.due(events, faults)
    ledger.malformed["grpc", kind] += sum(s == REJECTED for s, _ in due)
    if events and all(s == REJECTED for s, _ in due):
        assert answer.code == grpc.StatusCode.INVALID_ARGUMENT, answer
        assert answer.details.startswith("every event is invalid: "), answer.details
        for i, (_, fault) in enumerate(due[:20]):
            assert f"event {i} (" in answer.details and f"): {fault}: " in answer.details, (
                i,
                fault,
                answer.details,
            )
        ledger.record(events, [REJECTED] * len(events))
        return
    assert answer.code == grpc.StatusCode.OK, answer
    assert answer.response is not None, answer
    results = answer.response.results
    assert len(results) == len(events), results
    ledger.record(events, [r.status for r in results])
    assert [(r.status, r.field) for r in results] == due
    assert [r.event_id for r in results] == [e.event_id for e in events]
    assert all(r.error for r in results if r.status == REJECTED)


def assert_refused_http(answer: HttpAnswer, *mentions: str) -> None:
    assert answer.status == 400 and answer.content_type == "application/json", answer
    error = json.loads(answer.text)["error"]
    assert all(m in error for m in mentions), (mentions, error)


def assert_landed_exactly_once(front: Front, ledger: Ledger, stack_settings) -> None:
    records = read_topics(stack_settings)
    landed = Counter(event.event_id for items in records.values() for _, event in items)
    assert [i for i, n in landed.items() if n > 1] == []
    assert set(landed) == set(ledger.published)
    assert not set(landed) & (ledger.unpublished - set(ledger.published))
    assert not set(landed) & ledger.private
    for topic, items in records.items():
        for key, event in items:
            sent = telemetry_pb2.TelemetryEvent()
            sent.CopyFrom(ledger.published[event.event_id])
            sent.client_id = "fuzz-client"  # stamped by the gateway from the key
            assert (topic, key, event) == (
                topics.BY_PAYLOAD[sent.WhichOneof("payload")],
                sent.rollout_id.encode(),
                sent,
            )

    status, health = front.health()
    assert status == 200 and health["status"] == "ok"
    outcomes = ("accepted", "duplicate", "rejected", "retry", "privacy")
    assert {k: health[k] for k in (*outcomes, "inflight")} == {
        **{k: ledger.answered[k] for k in outcomes},
        "inflight": 0,
    }
    assert ledger.answered["retry"] == 0


# ---- good events ----


def good_event(
    payload: str,
    rollout_id: str | tuple = "r1",
    text: str | tuple = "x = 1\n",
    seconds: float = 5.0,
    outcome: telemetry_pb2.EditOutcome.Outcome = telemetry_pb2.EditOutcome.OUTCOME_ACCEPTED,
    age_ms: int = 1_000,
    private: bool = False,
) -> telemetry_pb2.TelemetryEvent:
    """A fresh event the gateway must take; a (character, count) text stands for that many."""
    rollout_id, text = (
        value[0] * value[1] if isinstance(value, tuple) else value for value in (rollout_id, text)
    )
    event = telemetry_pb2.TelemetryEvent(
        event_id=str(uuid.uuid4()),
        rollout_id=rollout_id,
        session_id="s1",
        user_id="u1",
        client_ts_ms=wall_ms() - age_ms,
        schema_version=1,
        privacy_mode=private,
    )
    if payload == "edit_shown":
        event.edit_shown.file_path, event.edit_shown.edit_text = "a.py", text
    elif payload == "edit_outcome":
        event.edit_outcome.outcome = outcome
    elif payload == "persistence":
        event.persistence.seconds_after_edit, event.persistence.region_text = seconds, text
    else:
        event.followup.seconds_after_edit, event.followup.message = seconds, text
    return event


def fresh_batch(n: int) -> list[telemetry_pb2.TelemetryEvent]:
    return [good_event(PAYLOADS[i % 4], rollout_id=f"r{i % 7}") for i in range(n)]


def as_json(events, proto_names: bool = False) -> bytes:
    request = ingest_pb2.PublishEventsRequest(events=events)
    return json_format.MessageToJson(
        request, preserving_proto_field_name=proto_names, indent=None
    ).encode()


def as_proto(events) -> bytes:
    return ingest_pb2.PublishEventsRequest(events=events).SerializeToString()


# ---- 1. malformed whole requests ----


@dataclass(frozen=True)
class Probe:
    """One request body (HTTP) or message (gRPC) and what the refusal must mention."""

    kind: str
    body: bytes
    events: tuple = ()
    """The good events the body was made from (to keep track of any that get through)."""
    mentions: tuple[str, ...] = ()
    authorization: str | None = None


def flip_bits(body: bytes, flips: list[tuple[int, int]]) -> bytes:
    out = bytearray(body)
    for at, bit in flips:
        out[at % len(out)] ^= 1 << bit
    return bytes(out)


def small_batches() -> st.SearchStrategy:
    return st.integers(1, 5).map(fresh_batch)


flips = st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 7)), min_size=1, max_size=4)
# Names at every level of the request, in both spellings: anything else is an unknown field.
KNOWN_NAMES = {
    name
    for message in (
        ingest_pb2.PublishEventsRequest,
        telemetry_pb2.TelemetryEvent,
        telemetry_pb2.EditShown,
        telemetry_pb2.EditOutcome,
        telemetry_pb2.PersistenceSnapshot,
        telemetry_pb2.FollowUp,
    )
    for f in message.DESCRIPTOR.fields
    for name in (f.name, f.json_name)
}
# "[name]" is how the JSON mapping spells an extension
unknown_names = st.text(min_size=1, max_size=20).filter(
    lambda s: s not in KNOWN_NAMES and not (s.startswith("[") and s.endswith("]"))
)
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=10),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)

# A JSON value of a type the field's mapping does not take. protobuf's parser reads an empty
# array or string where a message goes as the empty message, a bool as a double and a
# fraction as an enum number: test_json_of_the_wrong_type_is_refused_whole pins those.
objects = st.dictionaries(st.text(max_size=5), json_scalars, min_size=1, max_size=3)
arrays = st.lists(json_scalars, min_size=1, max_size=3).filter(
    lambda a: not all(isinstance(x, str) for x in a)
)
fractions = st.floats().filter(lambda x: not (math.isfinite(x) and x == int(x)))
letters = st.text(alphabet="abcxyz ", min_size=1)
WRONG_TYPES = {
    "string": st.one_of(st.booleans(), st.integers(), st.floats(), objects, arrays),
    "int64": st.one_of(st.booleans(), fractions, letters, objects, arrays),
    "uint32": st.one_of(
        st.booleans(),
        st.integers(max_value=-1),
        st.integers(min_value=2**32),
        letters,
        objects,
        arrays,
    ),
    "double": st.one_of(letters, objects, arrays),
    "bool": st.one_of(st.integers(), st.text(max_size=5), objects, arrays),
    "enum": st.one_of(letters, objects, arrays, st.integers(min_value=2**31)),
    "message": st.one_of(st.booleans(), st.integers(), st.floats(allow_nan=False), st.just("x")),
}
# (path from the event, JSON type) of every field a fresh_batch event can carry.
EVENT_FIELDS = {
    "edit_shown": [
        ("eventId", "string"),
        ("rolloutId", "string"),
        ("clientTsMs", "int64"),
        ("schemaVersion", "uint32"),
        ("editShown", "message"),
        ("editShown.filePath", "string"),
        ("editShown.editText", "string"),
    ],
    "edit_outcome": [
        ("sessionId", "string"),
        ("userId", "string"),
        ("privacyMode", "bool"),
        ("editOutcome.outcome", "enum"),
    ],
    "persistence": [
        ("persistence.secondsAfterEdit", "double"),
        ("persistence.regionText", "string"),
        ("persistence", "message"),
    ],
    "followup": [
        ("followup.secondsAfterEdit", "double"),
        ("followup.message", "string"),
        ("followup", "message"),
    ],
}


@st.composite
def wrong_type(draw) -> Probe:
    events = draw(small_batches())
    document = json.loads(as_json(events))
    at = draw(st.integers(0, len(events) - 1))
    path, json_type = draw(st.sampled_from(EVENT_FIELDS[events[at].WhichOneof("payload")]))
    *parents, name = path.split(".")
    target = document["events"][at]
    for parent in parents:
        target = target[parent]
    target[name] = draw(WRONG_TYPES[json_type])
    return Probe("wrong JSON type", json.dumps(document).encode(), tuple(events), mentions=(name,))


@st.composite
def unknown_field(draw) -> Probe:
    events = draw(small_batches())
    document = json.loads(as_json(events))
    name = draw(unknown_names)
    level = draw(st.sampled_from(["request", "event", "payload"]))
    event = document["events"][-1]
    payload = next(k for k in event if k in ("editShown", "editOutcome", "persistence", "followup"))
    target = {"request": document, "event": event, "payload": event[payload]}[level]
    target[name] = draw(json_values)
    return Probe("unknown field", json.dumps(document).encode(), tuple(events), mentions=(name,))


@st.composite
def deep_nesting(draw) -> Probe:
    depth = draw(st.integers(2, 200_000))
    opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
    nested = opener * depth + "1" + closer * depth
    where = draw(
        st.sampled_from(
            ["{}", '{{"events": {}}}', '{{"events": [{}]}}', '{{"events": [{{"editShown": {}}}]}}']
        )
    )
    return Probe("deep nesting", where.format(nested).encode())


@st.composite
def deep_groups(draw) -> Probe:
    # Unknown groups are parsed to their end, recursively: the parser's depth limit is ~100.
    depth = draw(st.integers(1, 100_000))
    closed = draw(st.integers(0, depth))
    nested = tag(15, 3) * depth + tag(15, 4) * closed
    event = nested if draw(st.booleans()) else tag(10, 2) + varint(len(nested)) + nested
    return Probe("deep nesting", tag(1, 2) + varint(len(event)) + event)


@st.composite
def non_utf8(draw) -> Probe:
    events = draw(small_batches())
    body = as_json(events)
    at = draw(st.integers(0, len(body)))
    # a stray byte, a cut sequence, a UTF-16 surrogate, an overlong '/', a 5-byte form
    junk = draw(
        st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf8\x88\x80\x80\x80"])
    )
    return Probe(
        "not UTF-8", body[:at] + junk + body[at:], tuple(events), mentions=("codec can't decode",)
    )


@st.composite
def truncated(draw, serialize) -> Probe:
    events = draw(small_batches())
    body = serialize(events)
    return Probe("truncated", body[: draw(st.integers(0, len(body) - 1))], tuple(events))


@st.composite
def bit_flipped(draw, serialize) -> Probe:
    events = draw(small_batches())
    return Probe("bit-flipped", flip_bits(serialize(events), draw(flips)), tuple(events))


@st.composite
def garbage_spliced(draw) -> Probe:
    events = draw(small_batches())
    body = as_proto(events)
    at = draw(st.integers(0, len(body)))
    return Probe(
        "garbage spliced in",
        body[:at] + draw(st.binary(min_size=1, max_size=32)) + body[at:],
        tuple(events),
    )


def varint(value: int) -> bytes:
    """``value`` as protobuf writes a varint, by protobuf's own encoder."""
    return encoder._VarintBytes(value)  # type: ignore[attr-defined]  # private: not in its stubs


def tag(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


# Fields 1-14 of an event written with any wire type: a known field with the wrong wire
# type is an unknown field to the parser, and the event then misses the real one.
wire_field = st.one_of(
    st.tuples(st.integers(1, 14), st.integers(0, 2**64 - 1)).map(
        lambda f: tag(f[0], 0) + varint(f[1])
    ),
    st.tuples(st.integers(1, 14), st.binary(max_size=40)).map(
        lambda f: tag(f[0], 2) + varint(len(f[1])) + f[1]
    ),
    st.tuples(st.integers(1, 14), st.binary(min_size=8, max_size=8)).map(
        lambda f: tag(f[0], 1) + f[1]
    ),
    st.tuples(st.integers(1, 14), st.binary(min_size=4, max_size=4)).map(
        lambda f: tag(f[0], 5) + f[1]
    ),
)


@st.composite
def wire_soup(draw) -> Probe:
    events = [
        draw(st.lists(wire_field, max_size=8).map(b"".join)) for _ in range(draw(st.integers(1, 4)))
    ]
    return Probe(
        "fields of any wire type",
        b"".join(tag(1, 2) + varint(len(e)) + e for e in events),
    )


@st.composite
def oversized_batch(draw, serialize) -> Probe:
    events = fresh_batch(draw(st.integers(MAX_BATCH + 1, 3 * MAX_BATCH)))
    return Probe("oversized batch", serialize(events), tuple(events))


@st.composite
def bad_api_key(draw, serialize) -> Probe:
    events = fresh_batch(2)
    token = draw(
        st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=60)
    )
    authorization = draw(st.sampled_from(["Bearer ", "bearer ", "Basic ", ""])) + token
    return Probe(
        "bad API key",
        serialize(events),
        tuple(events),
        mentions=("API key",),
        authorization=authorization,
    )


random_bytes = st.binary(max_size=512).map(lambda b: Probe("random bytes", b))
HTTP_PROBES = (
    random_bytes,
    st.text(alphabet=" \t\r\n", max_size=64).map(
        lambda s: Probe("empty body", s.encode(), mentions=("Expecting value",))
    ),
    non_utf8(),
    wrong_type(),
    unknown_field(),
    deep_nesting(),
    truncated(as_json),
    bit_flipped(as_json),
    oversized_batch(as_json),
    bad_api_key(as_json),
)
GRPC_PROBES = (
    random_bytes,  # b"" and a few others are an empty request: OK, no results
    truncated(as_proto),
    bit_flipped(as_proto),
    garbage_spliced(),
    wire_soup(),
    deep_groups(),
    oversized_batch(as_proto),
    bad_api_key(as_proto),
)


def send_http_probe(front: Front, ledger: Ledger, probe: Probe) -> None:
    request = json_mapping(probe.body)
    faults = (
        faults_at_gateway_clock(request.events)
        if request is not None and len(request.events) <= MAX_BATCH
        else []
    )
    answer = front.http(probe.body, probe.authorization)
    if probe.authorization is not None:
        assert answer.status == 401 and "API key" in json.loads(answer.text)["error"], answer
        ledger.refused(probe.events)
    elif request is None:
        assert_refused_http(answer, "rtrl.v1.PublishEventsRequest", *probe.mentions)
        ledger.refused(probe.events)
    elif len(request.events) > MAX_BATCH:
        assert_refused_http(answer, f"batch has {len(request.events)} events, at most {MAX_BATCH}")
        ledger.refused(probe.events)
    else:
        # Still a PublishEventsRequest (a bit flip inside a string, say): judged event by event.
        check_http_events(ledger, answer, request.events, faults, probe.kind)
        ledger.refused(probe.events)
        return
    ledger.malformed["http", probe.kind] += 1


def send_grpc_probe(front: Front, ledger: Ledger, probe: Probe) -> None:
    try:
        request = ingest_pb2.PublishEventsRequest.FromString(probe.body)
    except DecodeError:
        request = None
    faults = (
        faults_at_gateway_clock(request.events)
        if request is not None and len(request.events) <= MAX_BATCH
        else []
    )
    answer = front.grpc(probe.body, probe.authorization)
    if probe.authorization is not None:
        assert answer.code == grpc.StatusCode.UNAUTHENTICATED and "API key" in answer.details, (
            answer
        )
        ledger.refused(probe.events)
    elif request is None:
        assert answer.code == grpc.StatusCode.INVALID_ARGUMENT, answer
        assert answer.details.startswith(
            "request is not a serialized rtrl.v1.PublishEventsRequest: "
        ), answer.details
        ledger.refused(probe.events)
    elif len(request.events) > MAX_BATCH:
        too_many = f"batch has {len(request.events)} events, at most {MAX_BATCH} allowed"
        assert (answer.code, answer.details) == (grpc.StatusCode.INVALID_ARGUMENT, too_many)
        ledger.refused(probe.events)
    else:
        check_grpc_events(ledger, answer, request.events, faults, probe.kind)
        ledger.refused(probe.events)
        return
    ledger.malformed["grpc", probe.kind] += 1


@pytest.mark.guarantee(2)
@pytest.mark.slow
def test_malformed_requests_are_refused_whole_with_the_reason(front, stack_settings):
    ledger = Ledger()
    for probes, send, examples in (
        (HTTP_PROBES, send_http_probe, 260),
        (GRPC_PROBES, send_grpc_probe, 320),
    ):
        for strategy in probes:
            fuzz(strategy, examples, lambda probe, send=send: send(front, ledger, probe))

    for (end, kind), n in sorted(ledger.malformed.items()):
        print(f"{end:4} {kind:28} {n:6}")
    assert sum(n for (end, _), n in ledger.malformed.items() if end == "http") >= 2_000
    assert sum(n for (end, _), n in ledger.malformed.items() if end == "grpc") >= 2_000
    assert_landed_exactly_once(front, ledger, stack_settings)


# ---- 2. bad events among good ones ----

WHITESPACE = " \t\n\r\x0b\x0c\x1c\u00a0\u2003\u3000"
# One text in 20 at the size limit, exactly: in bytes, not characters. Long values are
# drawn as (character, count), so a failing example prints short.
AT_THE_LIMIT = (("x", MAX_TEXT_BYTES), ("é", MAX_TEXT_BYTES // 2))
good_texts = st.tuples(st.integers(0, 39), st.text(max_size=20)).map(
    lambda t: AT_THE_LIMIT[t[0]] if t[0] < 2 else t[1]
)
good_spec = st.fixed_dictionaries(
    {
        "payload": st.sampled_from(PAYLOADS),
        "rollout_id": st.one_of(
            st.text(min_size=1, max_size=16).filter(str.strip), st.just(("r", 128))
        ),
        "text": good_texts,
        "seconds": st.one_of(
            st.floats(min_value=0, max_value=1e12), st.sampled_from([0.0, -0.0, 5e-324])
        ),
        "outcome": st.sampled_from([1, 2]),
        # at most 4 minutes ahead, at least 15 minutes inside the 7-day window
        "age_ms": st.integers(-4 * 60_000, 7 * DAY_MS - 15 * 60_000),
        "private": st.integers(0, 9).map(lambda n: n == 9),
    }
)
non_canonical_ids = st.text(max_size=24).filter(lambda s: not _canonical_uuid(s))


def _canonical_uuid(value: str) -> bool:
    try:
        return str(uuid.UUID(value)) == value
    except ValueError:
        return False


# (field, how to spoil it); the recipes are resolved against a fresh uuid and the clock by spoil().
envelope_faults = st.one_of(
    st.tuples(
        st.just("event_id"),
        st.sampled_from(["upper", "braces", "urn", "hex", "padded", "fullwidth", "nul"]),
        st.none(),
    ),
    st.tuples(st.just("event_id"), st.just("text"), non_canonical_ids),
    st.tuples(st.just("event_id"), st.just("huge"), st.integers(129, 20_000)),
    st.tuples(
        st.sampled_from(["rollout_id", "session_id", "user_id"]),
        st.just("blank"),
        st.text(alphabet=WHITESPACE, max_size=4),
    ),
    st.tuples(
        st.sampled_from(["rollout_id", "session_id", "user_id"]),
        st.just("huge"),
        st.integers(129, 5_000),
    ),
    st.tuples(
        st.just("schema_version"),
        st.just("value"),
        st.integers(0, 2**32 - 1).filter(lambda v: v != 1),
    ),
    st.tuples(st.just("client_ts_ms"), st.sampled_from(["past", "future"]), st.integers(0, 2**63)),
)
negative_or_not_finite = st.one_of(
    st.floats(max_value=-5e-324), st.sampled_from([math.nan, math.inf, -math.nan])
)
payload_faults = st.one_of(
    st.tuples(st.just("payload"), st.just("none"), st.none()),
    st.tuples(
        st.just("edit_outcome.outcome"),
        st.just("value"),
        st.integers(-(2**31), 2**31 - 1).filter(lambda v: v not in (1, 2)),
    ),
    st.tuples(
        st.sampled_from(["persistence.seconds_after_edit", "followup.seconds_after_edit"]),
        st.just("value"),
        negative_or_not_finite,
    ),
    st.tuples(
        st.sampled_from(
            [
                "edit_shown.edit_text",
                "edit_shown.file_path",
                "persistence.region_text",
                "followup.message",
            ]
        ),
        st.just("oversized"),
        st.tuples(st.sampled_from(["x", "é", "€", "😀"]), st.integers(0, 50)),
    ),
)
# Up to three envelope faults and one in the payload, on an otherwise good event.
bad_spec = st.tuples(
    st.lists(envelope_faults, max_size=3, unique_by=lambda f: f[0]),
    st.none() | payload_faults,
    good_spec,
).filter(lambda spec: spec[0] or spec[1] is not None)
event_spec = st.one_of(
    good_spec.map(lambda g: ("good", g)),
    bad_spec.map(lambda b: ("bad", b)),
    bad_spec.map(lambda b: ("bad", b)),
    bad_spec.map(lambda b: ("bad", b)),
    st.tuples(st.just("resend"), st.integers(0, 10**9)),
    st.tuples(st.just("repeat"), st.integers(0, 10**9)),
    st.tuples(
        st.just("bad copy"), st.integers(0, 10**9), st.one_of(envelope_faults, payload_faults)
    ),
)
batches = st.tuples(st.lists(event_spec, min_size=20, max_size=40), st.booleans())


def spoil(event: telemetry_pb2.TelemetryEvent, fault: tuple) -> None:
    name, recipe, arg = fault
    if name == "event_id":
        canonical = event.event_id
        while canonical.upper() == canonical:  # all digits: no upper-case spelling
            canonical = str(uuid.uuid4())
        spellings = {
            "upper": canonical.upper(),
            "braces": "{" + canonical + "}",
            "urn": "urn:uuid:" + canonical,
            "hex": canonical.replace("-", ""),
            "padded": f" {canonical} ",
            "fullwidth": canonical.replace("4", "\uff14", 1),
            "nul": canonical + "\x00",
        }
        event.event_id = (
            arg if recipe == "text" else "a" * arg if recipe == "huge" else spellings[recipe]
        )
    elif name in ("rollout_id", "session_id", "user_id"):
        setattr(event, name, arg if recipe == "blank" else "é" * arg)
    elif name == "schema_version":
        event.schema_version = arg
    elif name == "client_ts_ms":
        now = wall_ms()
        # beyond the window by at least 10 minutes, so the gateway clock agrees
        if recipe == "past":
            event.client_ts_ms = max(now - 7 * DAY_MS - 10 * 60_000 - arg, -(2**63))
        else:
            event.client_ts_ms = min(now + 15 * 60_000 + arg, 2**63 - 1)
    elif name == "payload":
        event.ClearField("payload")
    else:
        kind, attribute = name.split(".")
        if event.WhichOneof("payload") != kind:
            event.ClearField("payload")
            getattr(event, kind).SetInParent()
        if recipe == "oversized":
            char, extra = arg
            limit = MAX_PATH_BYTES if attribute == "file_path" else MAX_TEXT_BYTES
            value = char * (limit // len(char.encode()) + 1 + extra)
        else:
            value = arg
        setattr(getattr(event, kind), attribute, value)


def first_fault(faults: list[tuple]) -> str:
    envelope = [f[0] for f in faults if f[0] in ENVELOPE]
    return min(envelope, key=ENVELOPE.index) if envelope else faults[-1][0]


def resolve(
    ledger: Ledger, specs: list[tuple]
) -> tuple[list[telemetry_pb2.TelemetryEvent], list[str | None]]:
    """The batch the specs describe and the field at fault in each event (None: good)."""
    events: list[telemetry_pb2.TelemetryEvent] = []
    faults: list[str | None] = []
    for spec in specs:
        if spec[0] == "good":
            events.append(good_event(**spec[1]))
            faults.append(None)
        elif spec[0] == "bad":
            envelope, payload, base = spec[1]
            event = good_event(**base)
            spoilers = [*envelope, *([payload] if payload else [])]
            for fault in spoilers:
                spoil(event, fault)
            events.append(event)
            faults.append(first_fault(spoilers))
        elif spec[0] == "repeat" and events:
            k = spec[1] % len(events)
            events.append(events[k])
            faults.append(faults[k])
        elif spec[0] == "resend" and ledger.accepted:
            events.append(ledger.accepted[spec[1] % len(ledger.accepted)])
            faults.append(None)
        elif spec[0] == "bad copy" and ledger.accepted:
            # an event the gateway has taken, spoilt: REJECTED, not DUPLICATE (its id upper-cased
            # must not pass as a new event either)
            event = telemetry_pb2.TelemetryEvent()
            event.CopyFrom(ledger.accepted[spec[1] % len(ledger.accepted)])
            spoil(event, spec[2])
            events.append(event)
            faults.append(spec[2][0])
    return events, faults


def send_batch(front: Front, ledger: Ledger, end: str, batch: tuple) -> None:
    specs, proto_names = batch
    events, faults = resolve(ledger, specs)
    assume(events)
    if end == "http":
        answer = front.http(as_json(events, proto_names))
        check_http_events(ledger, answer, events, faults, "bad event")
    else:
        check_grpc_events(ledger, front.grpc(as_proto(events)), events, faults, "bad event")


@pytest.mark.guarantee(2)
@pytest.mark.slow
def test_bad_events_are_rejected_by_field_and_good_ones_land_exactly_once(front, stack_settings):
    ledger = Ledger()
    # Alternating rounds, so that events accepted through one front end are resent through the other.
    for end in ("http", "grpc", "http", "grpc"):
        fuzz(batches, 130, lambda batch, end=end: send_batch(front, ledger, end, batch))

    print(dict(ledger.malformed), dict(ledger.answered))
    assert ledger.malformed["http", "bad event"] >= 3_000
    assert ledger.malformed["grpc", "bad event"] >= 3_000
    assert ledger.answered["duplicate"] > 0 and ledger.answered["privacy"] > 0
    assert_landed_exactly_once(front, ledger, stack_settings)


# ---- 3. what the fuzzers above leave out: the HTTP layer and the JSON mapping taken strictly ----
# One gateway for each table; every case runs, and the failures are listed together.

gzipped = gzip.compress(b'{"events": []}' * 50)
UNDECODABLE = [
    # (case, header lines, body, status, what the answer must mention)
    (
        "gzip declared, the body is not gzip",
        b"Content-Encoding: gzip\r\n",
        b"\x00junk",
        400,
        "gzip",
    ),
    (
        "gzip stream corrupt midway",
        b"Content-Encoding: gzip\r\n",
        gzipped[:20] + b"\xff" * 10 + gzipped[30:],
        400,
        "gzip",
    ),
    (
        "deflate declared, the body is not deflate",
        b"Content-Encoding: deflate\r\n",
        b"\x00junk",
        400,
        "deflate",
    ),
    (
        "a chunk size that is not hex",
        b"Transfer-Encoding: chunked\r\n",
        b"zz\r\nabc\r\n0\r\n\r\n",
        400,
        "chunk",
    ),
    (
        "Content-Length and chunked both",
        b"Transfer-Encoding: chunked\r\nContent-Length: 2\r\n",
        b"{}",
        400,
        "Content-Length",
    ),
    (
        "an API key that is not UTF-8",
        b"Authorization: Bearer \xff\xfe\r\n",
        b'{"events": []}',
        401,
        "API key",
    ),
    (
        "an encoding the gateway does not take",
        b"Content-Encoding: x-rot13\r\n",
        b'{"events": []}',
        415,
        "x-rot13",
    ),
    (
        "a gzip body without a Content-Length",
        b"Content-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n",
        b"5\r\nabcde\r\n0\r\n\r\n",
        411,
        "Content-Length",
    ),
]


def test_undecodable_http_requests_get_a_4xx_not_a_500(front):
    failures = []
    for case, header_lines, body, status, mention in UNDECODABLE:
        head = b"POST /v1/events HTTP/1.1\r\nHost: ingest\r\nConnection: close\r\n"
        if b"Authorization" not in header_lines:
            head += f"Authorization: Bearer {front.api_key}\r\n".encode()
        if b"Transfer-Encoding" not in header_lines:
            head += b"Content-Length: %d\r\n" % len(body)
        answer = front.raw_http(head + header_lines + b"\r\n" + body)
        if answer.status != status or mention.lower() not in answer.text.lower():
            failures.append(
                f"{case}: want {status} mentioning {mention!r}, got {answer.status} {answer.text[:100]!r}"
            )
    assert not failures, "\n".join(failures)
    assert front.health()[0] == 200


def test_a_compression_bomb_is_refused_before_the_key_and_stopped_at_the_bound_after(front):
    """A 61 MB gzip bomb (61 KB on the wire): refused with 401 on the headers alone without a
    key, and with one refused at max_inflation x its size, the rest left unread; the gateway
    keeps answering."""
    bomb = gzip.compress(b" " * (61 << 20), compresslevel=9)
    head = (
        b"POST /v1/events HTTP/1.1\r\nHost: ingest\r\nConnection: close\r\n"
        b"Content-Encoding: gzip\r\nContent-Length: %d\r\n" % len(bomb)
    )
    for authorization, status, mention in (
        (b"", 401, "API key"),
        (b"Authorization: Bearer not-a-key\r\n", 401, "unknown API key"),
        (f"Authorization: Bearer {front.api_key}\r\n".encode(), 413, "expands past 20x"),
    ):
        answer = front.raw_http(head + authorization + b"\r\n" + bomb)
        assert answer.status == status and mention in answer.text, (authorization, answer)
    assert front.health()[0] == 200
    # gRPC likewise: a stranger's request is refused on its metadata, before it is parsed.
    answer = front.grpc(b"\xff not a protobuf", "Bearer not-a-key")
    assert answer.code == grpc.StatusCode.UNAUTHENTICATED and "unknown API key" in answer.details, (
        answer
    )
    answer = front.grpc(b"\xff not a protobuf")
    assert answer.code == grpc.StatusCode.INVALID_ARGUMENT, answer
    # An honest compressed batch still goes through.
    body = gzip.compress(as_json([good_event("followup")]))
    head = (
        b"POST /v1/events HTTP/1.1\r\nHost: ingest\r\nConnection: close\r\n"
        b"Content-Encoding: gzip\r\nContent-Length: %d\r\n" % len(body)
    )
    answer = front.raw_http(
        head + f"Authorization: Bearer {front.api_key}\r\n".encode() + b"\r\n" + body
    )
    assert answer.status == 200, answer


def test_oversized_messages_are_refused_by_size(front):
    answer = front.http(b" " * (MAX_BODY_BYTES + 1))
    assert answer.status == 413 and str(MAX_BODY_BYTES) in answer.text, answer
    # gRPC refuses a message over max_receive_message_length itself, before the servicer
    # runs, with its own code; without a retry-after it does not read as backpressure.
    answer = front.grpc(b"\x00" * (MAX_BODY_BYTES + 1))
    assert (
        answer.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in answer.details
    ), answer
    assert "retry-after" not in dict(answer.trailing)


def one_good_event_with(payload: str, path: str, value) -> bytes:
    document = json.loads(as_json([good_event(payload)]))
    *parents, name = path.split(".")
    target = document["events"][0]
    for parent in parents:
        target = target[parent]
    target[name] = value
    return json.dumps(document).encode()


NOT_THE_JSON_MAPPING = [
    # protobuf's parser takes each of these; the proto3 JSON mapping does not
    ("a top-level array", lambda: b"[]"),
    ("a top-level string", lambda: b'""'),
    ("an event given as a string", lambda: b'{"events": [""]}'),
    ("an event given as an array", lambda: b'{"events": [[]]}'),
    ("a payload given as an array", lambda: one_good_event_with("edit_shown", "editShown", [])),
    ("a payload given as a string", lambda: one_good_event_with("followup", "followup", "")),
    (
        "a bool for a double",
        lambda: one_good_event_with("persistence", "persistence.secondsAfterEdit", True),
    ),
    (
        "a fraction for an enum",
        lambda: one_good_event_with("edit_outcome", "editOutcome.outcome", 1.5),
    ),
    (
        "a bool for an enum",
        lambda: one_good_event_with("edit_outcome", "editOutcome.outcome", True),
    ),
]


def test_json_of_the_wrong_type_is_refused_whole(front):
    failures = []
    for case, body in NOT_THE_JSON_MAPPING:
        answer = front.http(body())
        if (
            answer.status != 400
            or answer.content_type != "application/json"
            or "error" not in json.loads(answer.text)
        ):
            failures.append(
                f"{case}: want 400 with an error, got {answer.status} {answer.text[:100]!r}"
            )
    assert not failures, "\n".join(failures)
