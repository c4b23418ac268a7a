"""What one client can make the gateway write: events about rollouts no worker served are
stamped so (the joiner drops them when their window closes: M3), and a key's events are budgeted in bytes
as well as in count (M2)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import redis.asyncio as aioredis
from google.protobuf import json_format

from rtrl import kafka, topics
from rtrl.api_keys import SERVED_PREFIX, issue_key
from rtrl.ingest.server import start
from rtrl.key_budgets import ONE_CLIENT
from rtrl_client.client import make_event
from rtrl_client.v1 import ingest_pb2, telemetry_pb2
from support.ingest import ingest_settings, read_messages, shown
from support.signing import KEY_AUTHORITY

pytestmark = pytest.mark.integration


def _body(*events) -> str:
    return json_format.MessageToJson(
        ingest_pb2.PublishEventsRequest(events=list(events)), indent=None
    )


async def _post(http: aiohttp.ClientSession, url: str, key: str, *events) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"}
    async with http.post(f"{url}/v1/events", data=_body(*events), headers=headers) as response:
        return response.status, json.loads(await response.text())


def _edit_headers(stack_settings) -> dict[str, dict[str, object]]:
    """rollout_id -> the headers of its record on the edit topic."""
    found: dict[str, dict[str, object]] = {}
    for msg in read_messages(stack_settings, (topics.EDIT,)):
        event = telemetry_pb2.TelemetryEvent.FromString(msg.value() or b"")
        headers = msg.headers() or []
        found[event.rollout_id] = dict(headers.items() if isinstance(headers, dict) else headers)
    return found


@pytest.mark.guarantee(7)
def test_m3_events_about_a_rollout_no_worker_served_are_stamped_for_the_joiner(
    stack_settings, collect_kafka_clients
):
    """M3: the gateway knows which rollouts a worker served (the serving API marks each
    before its answer); an event about one it did not serve is written with
    kafka.UNSERVED_HEADER, which the joiner drops when its window closes, and one about a served rollout
    without it."""
    settings = ingest_settings(auth_required=True)

    async def scenario() -> None:
        redis = aioredis.Redis.from_url(stack_settings.redis_url)
        server = await start(stack_settings, settings)
        try:
            key = await issue_key(redis, KEY_AUTHORITY, "editor")
            await redis.set(SERVED_PREFIX + "r-served", "editor", ex=60)  # as the serving API does
            async with aiohttp.ClientSession() as http:
                url = f"http://127.0.0.1:{settings.http_port}"
                status, _ = await _post(http, url, key, shown("r-served"), shown("r-ghost"))
                assert status == 200
        finally:
            await server.stop()
            await redis.aclose()

    asyncio.run(scenario())
    headers = _edit_headers(stack_settings)
    assert kafka.UNSERVED_HEADER not in headers["r-served"]
    assert headers["r-ghost"].get(kafka.UNSERVED_HEADER) == b"1"


def _edit(rollout_id: str, n: int) -> telemetry_pb2.TelemetryEvent:
    """An edit at the gateway's bounds (a 4 KiB path, a 64 KiB text): 68 KB on the wire."""
    return make_event(
        rollout_id, "s1", "u1",
        edit_shown=telemetry_pb2.EditShown(file_path="p" * 4095, edit_text=f"{n}" + "x" * 65_000),
    )  # fmt: skip


@pytest.mark.guarantee(7)
def test_m2_a_keys_events_are_budgeted_in_bytes_as_well_as_in_count(
    stack_settings, collect_kafka_clients
):
    """M2: with the default budgets (20 events/s, bursts of 60), a key sending 68 KB events
    is refused with 429 naming its byte budget after ~7 of them (a burst of 60 x 8 KiB),
    not after 60 (+4 MB on the broker in one burst); another key is not held back, and
    small events of the same key's count budget still pass once bytes refill."""
    settings = ingest_settings(auth_required=True)

    async def scenario() -> tuple[list[int], dict, int]:
        redis = aioredis.Redis.from_url(stack_settings.redis_url)
        server = await start(stack_settings, settings)
        try:
            flood, quiet = [
                await issue_key(  # with what `rtrl keys create` gives a key
                    redis, KEY_AUTHORITY, client, rate_per_s=ONE_CLIENT.rate_per_s,
                    burst=ONE_CLIENT.burst, max_concurrency=ONE_CLIENT.max_concurrency,
                )
                for client in ("flood", "quiet")
            ]  # fmt: skip
            statuses: list[int] = []
            refusal: dict = {}
            async with aiohttp.ClientSession() as http:
                url = f"http://127.0.0.1:{settings.http_port}"
                for n in range(20):
                    status, body = await _post(http, url, flood, _edit(f"flood-{n}", n))
                    statuses.append(status)
                    refusal = body if status == 429 else refusal
                quiet_status, _ = await _post(http, url, quiet, _edit("quiet", 0))
            return statuses, refusal, quiet_status
        finally:
            await server.stop()
            await redis.aclose()

    statuses, refusal, quiet_status = asyncio.run(scenario())
    accepted = statuses.count(200)
    assert 5 <= accepted <= 9 and statuses[:accepted] == [200] * accepted, statuses
    assert 429 in statuses and "bytes" in refusal["error"], refusal
    assert quiet_status == 200
