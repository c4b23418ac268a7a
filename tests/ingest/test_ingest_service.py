"""The ingest service end to end: real broker and Redis, HTTP and gRPC front ends."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import aiohttp
import grpc
import pytest
import redis
import redis.asyncio as aioredis
from confluent_kafka import KafkaException
from google.protobuf import json_format

from rtrl import procs, runtime, topics
from rtrl.heartbeat import IngestBeat
from rtrl.ingest.gateway import ACCEPTED, DUPLICATE, REJECTED, RETRY, Gateway, dedup_key
from rtrl.ingest.server import start
from rtrl.procs import free_port
from rtrl_client.client import IngestClient, make_event
from rtrl_client.v1 import ingest_pb2, ingest_pb2_grpc, telemetry_pb2
from support import wait
from support.beats import beat_of, wait_for_beat
from support.ingest import followup, ingest_settings, persisted, read_topics, shown
from support.signing import EVENT_SIGNER

pytestmark = pytest.mark.integration


def statuses(response) -> list[int]:
    return [r.status for r in response.results]


def test_http_and_grpc_batches_land_once_each_on_their_topic(stack_settings, collect_kafka_clients):
    settings = ingest_settings()
    good = [
        shown("r1"),
        persisted("r1"),
        followup("r1"),
        shown("r2"),
        make_event("r2", "s1", "u1", edit_outcome=telemetry_pb2.EditOutcome.OUTCOME_ACCEPTED),
        persisted("r3"),
        followup("r3"),
    ]
    bad_id = shown("r4")
    bad_id.event_id = "nope"
    bad_schema = followup("r4")
    bad_schema.schema_version = 2
    private = [followup("r5", privacy_mode=True), persisted("r5", privacy_mode=True)]

    async def scenario():
        server = await start(stack_settings, settings)
        base = f"http://127.0.0.1:{settings.http_port}"
        try:
            async with aiohttp.ClientSession() as http:

                async def post(body: str):
                    async with http.post(
                        f"{base}/v1/events", data=body, headers={"Content-Type": "application/json"}
                    ) as r:
                        return r.status, await r.text()

                # camelCase JSON (MessageToJson's default) with one bad and one private event
                batch = ingest_pb2.PublishEventsRequest(events=[*good[:4], bad_id, private[0]])
                code, text = await post(json_format.MessageToJson(batch))
                assert code == 207
                answer = json_format.Parse(text, ingest_pb2.PublishEventsResponse())
                assert statuses(answer) == [ACCEPTED] * 4 + [REJECTED, ACCEPTED]
                assert (answer.results[4].field, answer.results[4].event_id) == ("event_id", "nope")
                assert "UUID" in answer.results[4].error

                # original field names; the first two were sent already; the second copy of
                # good[4] inside the same batch is a duplicate of the first
                batch = ingest_pb2.PublishEventsRequest(events=[good[0], good[1], good[4], good[4]])
                code, text = await post(
                    json_format.MessageToJson(batch, preserving_proto_field_name=True)
                )
                assert code == 200
                assert statuses(json_format.Parse(text, ingest_pb2.PublishEventsResponse())) == [
                    DUPLICATE,
                    DUPLICATE,
                    ACCEPTED,
                    DUPLICATE,
                ]

                # all rejected -> 400 with per-event results
                code, text = await post(
                    json_format.MessageToJson(ingest_pb2.PublishEventsRequest(events=[bad_schema]))
                )
                assert code == 400
                (only,) = json_format.Parse(text, ingest_pb2.PublishEventsResponse()).results
                assert (only.status, only.field) == (REJECTED, "schema_version")

                for garbage in ("{not json", '{"events": [{"rolloutId": 5, "bogus": 1}]}', "\xff"):
                    code, text = await post(garbage)
                    assert code == 400
                    assert "PublishEventsRequest" in json.loads(text)["error"]

                async with http.get(f"{base}/healthz") as r:
                    health = await r.json()
                assert r.status == 200 and health["accepted"] == 5 and health["privacy"] == 1

            async with grpc.aio.insecure_channel(f"127.0.0.1:{settings.grpc_port}") as channel:
                stub = ingest_pb2_grpc.IngestStub(channel)
                answer = await stub.PublishEvents(
                    ingest_pb2.PublishEventsRequest(
                        events=[good[5], good[6], good[3], bad_schema, private[1], private[0]]
                    )
                )
                assert statuses(answer) == [
                    ACCEPTED,
                    ACCEPTED,
                    DUPLICATE,
                    REJECTED,
                    ACCEPTED,
                    DUPLICATE,
                ]

            traffic_over = time.time()
            beats = redis.Redis.from_url(stack_settings.redis_url)
            status = await wait.until_async(
                lambda: beat_of(beats, IngestBeat, stack_settings.instance, after=traffic_over),
                "a beat written after the traffic",
                interval_s=0.1,
            )
            assert status is not None
            assert {
                k: getattr(status, k)
                for k in ("accepted", "duplicate", "rejected", "retry", "privacy")
            } == {
                "accepted": 7,
                "duplicate": 5,
                "rejected": 3,
                "retry": 0,
                "privacy": 2,
            }
        finally:
            await server.stop()

    asyncio.run(scenario())

    records = read_topics(stack_settings)
    expected_topic = {e.event_id: topics.BY_PAYLOAD[e.WhichOneof("payload")] for e in good}
    seen = [(topic, key, event) for topic, items in records.items() for key, event in items]
    assert sorted(event.event_id for _, _, event in seen) == sorted(expected_topic)
    for topic, key, event in seen:
        assert topic == expected_topic[event.event_id]
        assert key == event.rollout_id.encode()
        assert event == next(e for e in good if e.event_id == event.event_id)
    client = redis.Redis.from_url(stack_settings.redis_url)
    assert (client.get("rtrl:privacy:followup"), client.get("rtrl:privacy:persistence")) == (
        b"1",
        b"1",
    )


def test_backpressure_answers_429_and_the_client_retries_until_accepted(
    stack_settings, collect_kafka_clients
):
    settings = ingest_settings(max_inflight=2, retry_after_s=3)
    events = [shown(f"r{i}") for i in range(5)]

    async def scenario():
        server = await start(stack_settings, settings)
        url = f"http://127.0.0.1:{settings.http_port}"
        try:
            async with aiohttp.ClientSession() as http:
                body = json_format.MessageToJson(ingest_pb2.PublishEventsRequest(events=events))
                async with http.post(f"{url}/v1/events", data=body) as r:
                    assert (r.status, r.headers["Retry-After"]) == (429, "3")
                    answer = json_format.Parse(await r.text(), ingest_pb2.PublishEventsResponse())
            assert statuses(answer) == [ACCEPTED, ACCEPTED, RETRY, RETRY, RETRY]
            async with IngestClient(url, base_delay_s=0.01) as client:
                results = await client.publish(events)
            assert [r.status for r in results] == [
                DUPLICATE,
                DUPLICATE,
                ACCEPTED,
                ACCEPTED,
                ACCEPTED,
            ]
            assert [r.event_id for r in results] == [e.event_id for e in events]
        finally:
            await server.stop()

    asyncio.run(scenario())
    assert sorted(e.event_id for _, e in read_topics(stack_settings)[topics.EDIT]) == sorted(
        e.event_id for e in events
    )


def test_client_gives_up_with_retry_when_nothing_listens():
    async def scenario():
        async with IngestClient(
            f"http://127.0.0.1:{free_port()}", max_attempts=2, base_delay_s=0.01
        ) as client:
            return await client.publish([shown("r1")])

    (result,) = asyncio.run(scenario())
    assert result.status == RETRY and "gave up after 2 attempts" in result.error


class FailingProducer:
    async def send_batch(self, records):
        return [KafkaException("broker down") for _ in records]


class RecordingProducer:
    def __init__(self):
        self.sent = []

    async def send_batch(self, records):
        self.sent.extend((topic, key, value) for topic, value, key, _ in records)
        return [None for _ in records]


def test_failed_produce_releases_the_claim_so_the_resend_is_not_a_duplicate(redis_url):
    event = followup("r1")

    async def scenario():
        client = aioredis.Redis.from_url(redis_url)
        try:
            kwargs: dict[str, Any] = dict(
                dedup_ttl_s=3600, claim_ttl_s=30, max_inflight=10, signer=EVENT_SIGNER
            )
            (failed,) = await Gateway(FailingProducer(), client, **kwargs).publish([event])
            assert (failed.status, await client.exists(dedup_key(event.event_id))) == (RETRY, 0)
            assert "broker down" in failed.error

            recording = RecordingProducer()
            gateway = Gateway(recording, client, **kwargs)
            assert [r.status for r in await gateway.publish([event])] == [ACCEPTED]
            assert [r.status for r in await gateway.publish([event])] == [DUPLICATE]
            assert recording.sent == [(topics.FOLLOWUP, "r1", event.SerializeToString())]

            # a claim held by another request in flight: not a duplicate yet, come back later
            other = shown("r2")
            await client.set(dedup_key(other.event_id), "pending")
            (busy,) = await gateway.publish([other])
            assert (busy.status, busy.field) == (RETRY, "event_id")
            assert gateway.inflight == 0
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_ingest_process_accepts_events_and_stops_cleanly_on_sigterm(
    stack_settings, stack_env, tmp_path, repo_root
):
    http_port, grpc_port = free_port(), free_port()
    env = {
        **stack_env,
        "RTRL_INGEST_HTTP_PORT": str(http_port),
        "RTRL_INGEST_GRPC_PORT": str(grpc_port),
        "RTRL_INGEST_AUTH_REQUIRED": "false",
        "PYTHONPATH": str(repo_root),
    }
    proc = procs.spawn(
        "ingest",
        [sys.executable, "-m", "rtrl.ingest"],
        tmp_path / "ingest.log",
        env=env,
        port=http_port,
    )
    event = followup("r1")
    try:
        procs.wait_for_port(http_port, timeout_s=30)

        async def publish():
            async with IngestClient(f"http://127.0.0.1:{http_port}") as client:
                return await client.publish([event])

        assert [r.status for r in asyncio.run(publish())] == [ACCEPTED]
        client = redis.Redis.from_url(stack_settings.redis_url)
        wait_for_beat(
            client,
            IngestBeat,
            "a first beat",
            timeout_s=10,
            watching=[wait.Watched(proc, tmp_path / "ingest.log")],
        )
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        status: int | None
        try:
            # The service's watchdog ends a stop that overruns its budget, with every thread's
            # stack in the log; waiting longer than that only guards against the watchdog failing.
            status = proc.popen.wait(timeout=runtime.SHUTDOWN_BUDGET_S + 15)
        except subprocess.TimeoutExpired:
            proc.stop(timeout_s=1)
            status = None
        assert status == 0, (tmp_path / "ingest.log").read_text()
    assert [e.event_id for _, e in read_topics(stack_settings)[topics.FOLLOWUP]] == [event.event_id]
