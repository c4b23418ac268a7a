"""A batch nested past the JSON bound is a 400 at the gateway's HTTP door, not a 500
(guarantee 7, L4), and the next batch is served."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from google.protobuf import json_format

from rtrl.bounded_json import MAX_JSON_DEPTH
from rtrl.ingest.server import start
from support.ingest import ingest_settings, shown

pytestmark = pytest.mark.integration

DEEP = 100_000


@pytest.mark.guarantee(7)
def test_a_batch_nested_100k_deep_is_a_400_and_the_gateway_serves_on(
    stack_settings, collect_kafka_clients
):
    """L4: JSON nested past the bound is refused by the gateway's own bound, naming it (at
    e9251e0 protobuf's parser caught the RecursionError: a 400 whose reason was the
    parser's stack)."""
    settings = ingest_settings()
    good = json.dumps({"events": [json_format.MessageToDict(shown("r-deep"))]})
    bodies = {
        "deep events": '{"events": ' + "[" * DEEP + "]" * DEEP + "}",
        "one level past the bound": '{"events": '
        + "[" * MAX_JSON_DEPTH
        + "]" * MAX_JSON_DEPTH
        + "}",
    }

    async def scenario() -> dict[str, tuple[int, str]]:
        server = await start(stack_settings, settings)
        answers = {}
        try:
            url = f"http://127.0.0.1:{settings.http_port}/v1/events"
            headers = {"Content-Type": "application/json"}
            async with aiohttp.ClientSession() as http:
                for name, body in [*bodies.items(), ("good", good)]:
                    async with http.post(url, data=body, headers=headers) as response:
                        answers[name] = (response.status, await response.text())
        finally:
            await server.stop()
        return answers

    answers = asyncio.run(scenario())
    for name in bodies:
        status, text = answers[name]
        assert status == 400 and "nested" in text, (name, status, text[:300])
    assert answers["good"][0] == 200, answers["good"]
