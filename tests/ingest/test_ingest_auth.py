"""Who may send: API keys (missing, unknown, revoked, rotated, scoped), rate limits,
TLS, privacy mode enforced at the gateway, and trace context into Kafka headers.

Every test talks to a real gateway (HTTP and gRPC) on a Tansu broker and Redis."""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess

import aiohttp
import grpc
import pytest
import redis.asyncio as aioredis
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from google.protobuf import json_format

from rtrl import kafka, signing
from rtrl.api_keys import (
    KEY_PREFIX,
    SERVED_PREFIX,
    KeyAuthority,
    issue_key,
    key_hash,
    register_private_user,
    revoke_key,
    rotate_keys,
)
from rtrl.ingest.gateway import ACCEPTED, REJECTED
from rtrl.ingest.server import start
from rtrl_client.client import make_event
from rtrl_client.v1 import ingest_pb2, ingest_pb2_grpc, telemetry_pb2
from support.ingest import followup, ingest_settings, persisted, read_topics, shown
from support.signing import KEY_AUTHORITY

pytestmark = pytest.mark.integration
OUTCOME_ACCEPTED = telemetry_pb2.EditOutcome.OUTCOME_ACCEPTED


def _bytes(reply: bytes | str) -> bytes:
    """A redis reply: bytes, as the tests' clients do not decode responses (redis types it
    bytes | str)."""
    assert isinstance(reply, bytes), reply
    return reply


def _body(*events) -> str:
    return json_format.MessageToJson(
        ingest_pb2.PublishEventsRequest(events=list(events)), indent=None
    )


async def _post(
    http: aiohttp.ClientSession, url: str, body: str, key: str | None = None, **headers
) -> tuple[int, dict, dict]:
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    async with http.post(f"{url}/v1/events", data=body, headers=headers) as response:
        return response.status, json.loads(await response.text()), dict(response.headers)


async def _grpc(port: int, key: str | None, *events, credentials=None):
    target = f"127.0.0.1:{port}"
    channel = (
        grpc.aio.secure_channel(target, credentials)
        if credentials
        else grpc.aio.insecure_channel(target)
    )
    async with channel:
        metadata = (("authorization", f"Bearer {key}"),) if key else ()
        return await ingest_pb2_grpc.IngestStub(channel).PublishEvents(
            ingest_pb2.PublishEventsRequest(events=list(events)), metadata=metadata
        )


@pytest.mark.guarantee(7)
def test_keys_missing_unknown_revoked_rotated_and_scoped_are_refused(
    stack_settings, collect_kafka_clients
):
    settings = ingest_settings(auth_required=True, key_cache_ttl_s=0.1)

    async def scenario():
        redis = aioredis.Redis.from_url(stack_settings.redis_url)
        server = await start(stack_settings, settings)
        url = f"http://127.0.0.1:{settings.http_port}"
        try:
            good = await issue_key(redis, KEY_AUTHORITY, "editor")
            doomed = await issue_key(redis, KEY_AUTHORITY, "editor")
            chat_only = await issue_key(redis, KEY_AUTHORITY, "chat-widget", scopes={"followup"})
            async with aiohttp.ClientSession() as http:
                assert (await _post(http, url, _body(shown("r1")), good))[0] == 200

                for key, reason in (
                    (None, "missing API key"),
                    ("rtrl_not-a-key", "unknown API key"),
                ):
                    code, document, _ = await _post(http, url, _body(shown("r2")), key)
                    assert code == 401 and reason in document["error"], document
                code, document, _ = await _post(
                    http, url, "{}", None, Authorization="Basic dXNlcjpwdw=="
                )
                assert code == 401 and "Bearer" in document["error"]

                assert await revoke_key(redis, KEY_AUTHORITY, doomed)
                await asyncio.sleep(0.2)  # the gateway's key cache ttl
                code, document, _ = await _post(http, url, _body(shown("r3")), doomed)
                assert code == 401 and "revoked" in document["error"]

                # A key scoped to follow-ups: a batch of edits is forbidden, a mixed batch keeps the follow-up only.
                code, document, _ = await _post(
                    http, url, _body(shown("r4"), persisted("r4")), chat_only
                )
                assert code == 403 and "may send only followup" in document["error"]
                code, document, _ = await _post(
                    http, url, _body(shown("r5"), followup("r5")), chat_only
                )
                answer = json_format.ParseDict(document, ingest_pb2.PublishEventsResponse())
                assert code == 207 and [r.status for r in answer.results] == [REJECTED, ACCEPTED]
                assert (
                    answer.results[0].field == "payload"
                    and "may not send edit_shown" in answer.results[0].error
                )

                # Rotation: the old key keeps working for the grace period, then expires.
                rotated = await rotate_keys(redis, KEY_AUTHORITY, "editor", grace_s=0.5)
                assert (await _post(http, url, _body(shown("r6")), good))[0] == 200
                await asyncio.sleep(0.7)  # the 0.5 s grace elapsing is what is tested
                code, document, _ = await _post(http, url, _body(shown("r7")), good)
                assert code == 401 and "expired" in document["error"]
                assert (await _post(http, url, _body(shown("r7")), rotated))[0] == 200

            # The same refusals over gRPC.
            cases = [
                (None, grpc.StatusCode.UNAUTHENTICATED, "missing"),
                ("rtrl_nope", grpc.StatusCode.UNAUTHENTICATED, "unknown"),
                (doomed, grpc.StatusCode.UNAUTHENTICATED, "revoked"),
                (good, grpc.StatusCode.UNAUTHENTICATED, "expired"),
                (chat_only, grpc.StatusCode.PERMISSION_DENIED, "may send only followup"),
            ]
            for key, code, reason in cases:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await _grpc(settings.grpc_port, key, shown("r8"))
                assert refused.value.code() == code and reason in refused.value.details()
            answer = await _grpc(settings.grpc_port, rotated, shown("r8"))
            assert [r.status for r in answer.results] == [ACCEPTED]
        finally:
            await server.stop()
            await redis.aclose()

    asyncio.run(scenario())
    landed = {
        event.rollout_id for records in read_topics(stack_settings).values() for _, event in records
    }
    assert landed == {"r1", "r5", "r6", "r7", "r8"}


def test_key_records_written_to_redis_by_anyone_but_the_operator_open_nothing(
    stack_settings, collect_kafka_clients
):
    """The trust issue's finding: one HSET minted a working API key. Records are signed by
    the operator now: minted, widened, un-revoked or re-pointed records are no keys."""
    settings = ingest_settings(auth_required=True, key_cache_ttl_s=0.05)

    async def scenario():
        redis = aioredis.Redis.from_url(stack_settings.redis_url)
        server = await start(stack_settings, settings)
        url = f"http://127.0.0.1:{settings.http_port}"
        try:
            honest = await issue_key(redis, KEY_AUTHORITY, "editor")
            narrow = await issue_key(redis, KEY_AUTHORITY, "chat-widget", scopes={"followup"})
            revoked = await issue_key(redis, KEY_AUTHORITY, "editor")
            assert await revoke_key(redis, KEY_AUTHORITY, revoked)
            record = {
                _bytes(k).decode(): _bytes(v)
                for k, v in (await redis.hgetall(KEY_PREFIX + key_hash(honest))).items()
            }

            attacks = {}
            # 1. A record minted from scratch, as before: no signature.
            minted = "rtrl_minted-by-hset"
            await redis.hset(KEY_PREFIX + key_hash(minted), mapping={
                "client_id": "attacker", "scopes": "*", "rate_per_s": 0, "burst": 1, "revoked": 0, "expires_ms": 0,
                "max_request_bytes": 0, "max_tokens": 0, "max_concurrency": 0,
            })  # fmt: skip
            attacks["minted"] = minted
            # 2. An honest record (signature and all) copied under the attacker's own key's hash.
            copied = "rtrl_copied-record"
            # redis types the mapping's keys invariantly (Mapping[FieldT, ...]): a dict[str, ...] is refused.
            await redis.hset(KEY_PREFIX + key_hash(copied), mapping=record)  # type: ignore[arg-type]
            attacks["copied"] = copied
            # 3. A narrow key's scopes widened in place.
            await redis.hset(KEY_PREFIX + key_hash(narrow), "scopes", "*")
            attacks["widened"] = narrow
            # 4. A revoked key un-revoked in place.
            await redis.hset(KEY_PREFIX + key_hash(revoked), "revoked", 0)
            attacks["un-revoked"] = revoked
            # 5. Signed by a key the gateway does not know.
            stranger = KeyAuthority(signing.generate_private_key())
            foreign = "rtrl_foreign-operator"
            fields = {
                k: v.decode() for k, v in record.items() if k not in ("sig", "signer", "created_ms")
            }
            await redis.hset(
                KEY_PREFIX + key_hash(foreign),
                mapping=stranger.signed(key_hash(foreign), fields),  # type: ignore[arg-type]  # as above
            )
            attacks["stranger"] = foreign
            await asyncio.sleep(0.1)  # past the key cache

            async with aiohttp.ClientSession() as http:
                for name, key in attacks.items():
                    code, document, _ = await _post(http, url, _body(shown(f"attack-{name}")), key)
                    assert code == 401 and "unknown API key" in document["error"], (
                        name,
                        code,
                        document,
                    )
                assert (await _post(http, url, _body(shown("honest")), honest))[0] == 200
            assert server.admission.keys is not None
            assert server.admission.keys.forged >= len(attacks)
        finally:
            await server.stop()
            await redis.aclose()

    asyncio.run(scenario())
    landed = {
        event.rollout_id for records in read_topics(stack_settings).values() for _, event in records
    }
    assert landed == {"honest"}


def test_telemetry_about_a_rollout_served_to_another_client_is_refused(
    stack_settings, collect_kafka_clients
):
    """Rollout ids are bound to the key they were served to (the serving API records it):
    another key's events about them are REJECTED, and every event carries the client_id of
    the key it came with, whatever the client wrote in it (the joiner checks it again)."""
    settings = ingest_settings(auth_required=True)

    async def scenario():
        redis = aioredis.Redis.from_url(stack_settings.redis_url)
        server = await start(stack_settings, settings)
        url = f"http://127.0.0.1:{settings.http_port}"
        try:
            owner = await issue_key(redis, KEY_AUTHORITY, "editor")
            intruder = await issue_key(redis, KEY_AUTHORITY, "intruder")
            await redis.set(SERVED_PREFIX + "r-served", "editor")  # as the serving API does
            async with aiohttp.ClientSession() as http:
                code, document, _ = await _post(
                    http, url, _body(shown("r-served"), persisted("r-unknown")), intruder
                )
                answer = json_format.ParseDict(document, ingest_pb2.PublishEventsResponse())
                assert code == 207 and [r.status for r in answer.results] == [REJECTED, ACCEPTED]
                assert (
                    answer.results[0].field == "rollout_id"
                    and "served to another client" in answer.results[0].error
                )
                spoofed = shown("r-served")
                spoofed.client_id = "someone-else"
                assert (await _post(http, url, _body(spoofed), owner))[0] == 200
        finally:
            await server.stop()
            await redis.aclose()

    asyncio.run(scenario())
    landed = {
        event.rollout_id: event.client_id
        for records in read_topics(stack_settings).values()
        for _, event in records
    }
    assert landed == {"r-served": "editor", "r-unknown": "intruder"}


def test_rate_limit_answers_429_and_resource_exhausted_with_retry_after(
    stack_settings, collect_kafka_clients
):
    settings = ingest_settings(auth_required=True)

    async def scenario():
        redis = aioredis.Redis.from_url(stack_settings.redis_url)
        server = await start(stack_settings, settings)
        url = f"http://127.0.0.1:{settings.http_port}"
        try:
            # Slow refill: the test's own pauses (the first produce connects to the broker) must not refill it.
            key = await issue_key(redis, KEY_AUTHORITY, "chatty", rate_per_s=0.5, burst=10)
            quiet = await issue_key(redis, KEY_AUTHORITY, "quiet", rate_per_s=0.5, burst=10)
            async with aiohttp.ClientSession() as http:
                assert (await _post(http, url, _body(*[shown(f"a{i}") for i in range(10)]), key))[
                    0
                ] == 200
                code, document, headers = await _post(
                    http, url, _body(*[shown(f"b{i}") for i in range(5)]), key
                )
                assert code == 429 and "rate limit of client 'chatty'" in document["error"]
                assert int(headers["Retry-After"]) >= 5
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _grpc(settings.grpc_port, key, *[shown(f"c{i}") for i in range(5)])
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert int(dict(refused.value.trailing_metadata())["retry-after"]) >= 5
            # Buckets are per key: another client is not held back.
            assert [
                r.status
                for r in (
                    await _grpc(settings.grpc_port, quiet, *[shown(f"d{i}") for i in range(5)])
                ).results
            ] == [ACCEPTED] * 5
        finally:
            await server.stop()
            await redis.aclose()

    asyncio.run(scenario())


def _every_record_on_the_broker(stack_settings) -> list[tuple[str, bytes]]:
    """(topic, value) of every record on every topic the broker has."""
    probe = Consumer(kafka.consumer_config(stack_settings, "test-every-topic"))
    try:
        metadata = probe.list_topics(timeout=5).topics
        tps = [
            TopicPartition(t, p, OFFSET_BEGINNING) for t in metadata for p in metadata[t].partitions
        ]
        ends = {k: v for k, v in kafka.end_offsets(stack_settings, tps).items() if v > 0}
        probe.assign(tps)
        out = []
        while ends:
            messages = probe.consume(500, timeout=1.0)
            assert messages or not ends, f"could not read to the end of {ends}"
            for message in messages:
                topic, partition, offset = kafka.record_position(message)
                value = message.value()
                assert value is not None, (topic, partition, offset)
                out.append((topic, value))
                if offset + 1 >= ends.get((topic, partition), 0):
                    ends.pop((topic, partition), None)
        return out
    finally:
        probe.close()


@pytest.mark.guarantee(5)
def test_privacy_mode_events_reach_no_topic_only_counters(stack_settings, collect_kafka_clients):
    settings = ingest_settings(auth_required=True)
    secret = "def rotate_keys(): # PRIVATE CODE"

    async def scenario():
        redis = aioredis.Redis.from_url(stack_settings.redis_url)
        server = await start(stack_settings, settings)
        url = f"http://127.0.0.1:{settings.http_port}"
        try:
            key = await issue_key(redis, KEY_AUTHORITY, "editor")
            await register_private_user(redis, "private-user")
            flagged = make_event(
                "p1",
                "s",
                "u1",
                edit_shown=telemetry_pb2.EditShown(file_path="x.py", edit_text=secret),
                privacy_mode=True,
            )
            registered = make_event(
                "p2",
                "s",
                "private-user",
                followup=telemetry_pb2.FollowUp(seconds_after_edit=1, message=secret),
            )
            public = make_event(
                "p3",
                "s",
                "u1",
                edit_shown=telemetry_pb2.EditShown(file_path="x.py", edit_text="x = 1\n"),
            )
            async with aiohttp.ClientSession() as http:
                code, document, _ = await _post(http, url, _body(flagged, registered, public), key)
                answer = json_format.ParseDict(document, ingest_pb2.PublishEventsResponse())
                assert code == 200 and [r.status for r in answer.results] == [ACCEPTED] * 3
                code, document, _ = await _post(http, url, _body(flagged, registered), key)
                assert [r["status"] for r in document["results"]] == ["STATUS_DUPLICATE"] * 2
            answer = await _grpc(
                settings.grpc_port,
                key,
                make_event("p4", "s", "private-user", edit_outcome=OUTCOME_ACCEPTED),
            )
            assert [r.status for r in answer.results] == [ACCEPTED]
            assert {
                _bytes(k).decode(): int(v)
                for k in await redis.keys("rtrl:privacy:*")
                if (v := await redis.get(k)) is not None
            } == {
                "rtrl:privacy:edit_shown": 1,
                "rtrl:privacy:followup": 1,
                "rtrl:privacy:edit_outcome": 1,
            }
            assert server.gateway.counters.privacy == 3 and server.gateway.counters.accepted == 1
            # A user who leaves privacy mode is published again.
            await register_private_user(redis, "private-user", private=False)
            answer = await _grpc(
                settings.grpc_port,
                key,
                make_event("p5", "s", "private-user", edit_outcome=OUTCOME_ACCEPTED),
            )
            assert [r.status for r in answer.results] == [ACCEPTED]
        finally:
            await server.stop()
            await redis.aclose()

    asyncio.run(scenario())
    records = _every_record_on_the_broker(stack_settings)
    assert records, "the public events must be there, or this proves nothing"
    for topic, value in records:
        assert secret.encode() not in value, f"private text on {topic}"
    rollouts = {
        telemetry_pb2.TelemetryEvent.FromString(v).rollout_id
        for t, v in records
        if t.startswith("telemetry.")
    }
    assert rollouts == {"p3", "p5"}


def test_traceparent_continues_into_kafka_headers(
    stack_settings, collect_kafka_clients, otel_memory
):
    spans, _ = otel_memory
    spans.clear()
    settings = ingest_settings(auth_required=False)
    client_trace = "0af7651916cd43dd8448eb211c80319c"
    traceparent = f"00-{client_trace}-b7ad6b7169203331-01"

    async def scenario():
        server = await start(stack_settings, settings)
        try:
            async with aiohttp.ClientSession() as http:
                code, _, _ = await _post(
                    http,
                    f"http://127.0.0.1:{settings.http_port}",
                    _body(shown("t1"), followup("t1")),
                    traceparent=traceparent,
                )
                assert code == 200
        finally:
            await server.stop()

    asyncio.run(scenario())
    (span,) = [s for s in spans.get_finished_spans() if s.name == "ingest publish"]
    assert (
        f"{span.context.trace_id:032x}" == client_trace
        and f"{span.parent.span_id:016x}" == "b7ad6b7169203331"
    )
    assert span.kind.name == "PRODUCER" and span.attributes["messaging.system"] == "kafka"
    assert span.attributes["messaging.batch.message_count"] == 2
    probe = Consumer(kafka.consumer_config(stack_settings, "test-headers"))
    try:
        tps = [
            TopicPartition(t, p, OFFSET_BEGINNING)
            for t in ("telemetry.edit.v1", "telemetry.followup.v1")
            for p in range(stack_settings.kafka_partitions)
        ]
        probe.assign(tps)
        headers: list[dict[str, bytes | None]] = []
        for _ in range(20):
            headers += [
                dict(kafka.record_headers(m))
                for m in probe.consume(10, timeout=0.3)
                if m.error() is None
            ]
            if len(headers) == 2:
                break
    finally:
        probe.close()
    assert [h["traceparent"] for h in headers] == [
        f"00-{client_trace}-{span.context.span_id:016x}-01".encode()
    ] * 2


def test_tls_only_when_configured(stack_settings, collect_kafka_clients, tmp_path):
    cert, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key_file),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    settings = ingest_settings(auth_required=True, tls_cert_file=cert, tls_key_file=key_file)

    async def scenario():
        redis = aioredis.Redis.from_url(stack_settings.redis_url)
        server = await start(stack_settings, settings)
        try:
            key = await issue_key(redis, KEY_AUTHORITY, "editor")
            trusted = ssl.create_default_context(cafile=str(cert))
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=trusted)) as http:
                code, _, _ = await _post(
                    http, f"https://127.0.0.1:{settings.http_port}", _body(shown("s1")), key
                )
                assert code == 200
            async with aiohttp.ClientSession() as http:
                with pytest.raises(aiohttp.ClientError):
                    await _post(
                        http, f"http://127.0.0.1:{settings.http_port}", _body(shown("s2")), key
                    )
                with pytest.raises(aiohttp.ClientConnectorCertificateError):
                    await _post(
                        http, f"https://127.0.0.1:{settings.http_port}", _body(shown("s2")), key
                    )
            answer = await _grpc(
                settings.grpc_port,
                key,
                shown("s3"),
                credentials=grpc.ssl_channel_credentials(cert.read_bytes()),
            )
            assert [r.status for r in answer.results] == [ACCEPTED]
            with pytest.raises(grpc.aio.AioRpcError):
                await asyncio.wait_for(_grpc(settings.grpc_port, key, shown("s4")), 5)
        finally:
            await server.stop()
            await redis.aclose()

    asyncio.run(scenario())
    assert {
        e.rollout_id for records in read_topics(stack_settings).values() for _, e in records
    } == {"s1", "s3"}
