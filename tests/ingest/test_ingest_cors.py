"""Browsers: a page of an allowed origin (RTRL_INGEST_CORS_ORIGINS) may send events and read
every answer; any other origin, method or header is refused at the preflight and gets no
CORS header, and a configured origin must be exactly one origin."""

import asyncio
import json

import aiohttp
import pytest
import redis.asyncio as aioredis
from google.protobuf import json_format
from pydantic import ValidationError

from rtrl.api_keys import issue_key
from rtrl.ingest.config import IngestSettings, web_origin
from rtrl.ingest.server import start
from support.ingest import ingest_settings, read_topics, shown
from support.signing import KEY_AUTHORITY

APP = "http://127.0.0.1:5173"
ALLOW = "Access-Control-Allow-Origin"


async def _preflight(
    http, url: str, origin: str, method="POST", headers="authorization, content-type"
):
    async with http.options(
        f"{url}/v1/events",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": method,
            "Access-Control-Request-Headers": headers,
        },
    ) as response:
        return response.status, dict(response.headers)


@pytest.mark.integration
def test_only_an_allowed_origin_passes_the_preflight_and_reads_the_answers(
    stack_settings, collect_kafka_clients
):
    settings = ingest_settings(auth_required=True, cors_origins=[APP + "/"])

    async def scenario():
        redis = aioredis.Redis.from_url(stack_settings.redis_url)
        server = await start(stack_settings, settings)
        url = f"http://127.0.0.1:{settings.http_port}"
        try:
            key = await issue_key(redis, KEY_AUTHORITY, "web-app", scopes={"edit_shown"})
            async with aiohttp.ClientSession() as http:
                status, headers = await _preflight(http, url, APP)
                assert status == 204 and headers[ALLOW] == APP
                assert headers["Access-Control-Allow-Methods"] == "POST"
                assert "authorization" in headers["Access-Control-Allow-Headers"]
                # What the TypeScript SDK's browser build sends: its name in X-Rtrl-Sdk (a
                # browser's fetch may not set User-Agent).
                sdk_headers = "content-type, authorization, X-Rtrl-Sdk"
                status, headers = await _preflight(http, url, APP, "POST", sdk_headers)
                assert status == 204 and headers[ALLOW] == APP
                allowed = headers["Access-Control-Allow-Headers"].split(", ")
                assert "x-rtrl-sdk" in allowed
                for origin, method, asked in (
                    ("http://127.0.0.1:5174", "POST", "content-type"),  # another port
                    ("https://127.0.0.1:5173", "POST", "content-type"),  # another scheme
                    ("null", "POST", "content-type"),  # a sandboxed page
                    (APP, "DELETE", "content-type"),
                    (APP, "POST", "content-type, x-forwarded-for"),
                    # The SDK's name is let through exactly, not as a prefix or a pattern.
                    (APP, "POST", "content-type, x-rtrl-sdk-debug"),
                    (APP, "POST", "content-type, x-rtrl"),
                    (APP, "POST", "content-type, user-agent"),
                ):
                    status, headers = await _preflight(http, url, origin, method, asked)
                    assert status == 403 and ALLOW not in headers, (origin, method, asked)

                # What a page sends: the JSON form of a batch, with the key as a Bearer token.
                event = json_format.MessageToDict(shown("r-web"))
                payload = json.dumps({"events": [event]})
                for auth, expected in ((f"Bearer {key}", 200), ("Bearer rtrl_not-a-key", 401)):
                    async with http.post(
                        f"{url}/v1/events",
                        data=payload,
                        headers={
                            "Origin": APP,
                            "Authorization": auth,
                            "Content-Type": "application/json",
                        },
                    ) as response:
                        assert response.status == expected
                        assert response.headers[ALLOW] == APP, "a page reads refusals too"
                        assert response.headers["Access-Control-Expose-Headers"] == "Retry-After"
                async with http.post(
                    f"{url}/v1/events",
                    data=payload,
                    headers={
                        "Origin": "https://elsewhere.example",
                        "Authorization": f"Bearer {key}",
                    },
                ) as response:
                    # Not a browser's concern here: the key decides; the page just cannot read it.
                    assert ALLOW not in response.headers
        finally:
            await server.stop()
            await redis.aclose()

    asyncio.run(scenario())
    landed = [e.rollout_id for _, e in read_topics(stack_settings)["telemetry.edit.v1"]]
    assert landed.count("r-web") == 1, "the later posts are the same event: duplicates"


def test_without_origins_no_preflight_is_answered(stack_settings, collect_kafka_clients):
    settings = ingest_settings()
    assert settings.cors_origins == []

    async def scenario():
        server = await start(stack_settings, settings)
        try:
            async with aiohttp.ClientSession() as http:
                status, headers = await _preflight(
                    http, f"http://127.0.0.1:{settings.http_port}", APP
                )
                assert status == 403 and ALLOW not in headers and "Vary" not in headers
        finally:
            await server.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("given", "origin"),
    [
        ("https://App.Example.com", "https://app.example.com"),
        ("https://app.example.com:443/", "https://app.example.com"),
        ("http://127.0.0.1:5173", "http://127.0.0.1:5173"),
        ("http://[::1]:8080", "http://[::1]:8080"),
    ],
)
def test_an_origin_is_normalized_as_a_browser_sends_it(given, origin):
    assert web_origin(given) == origin


@pytest.mark.parametrize(
    "given",
    ["*", "https://*.example.com", "app.example.com", "ftp://app.example.com",
     "https://app.example.com/path", "https://user:pw@app.example.com", "https://a.com?x=1",
     "https://a.com:99999", "null", ""],
)  # fmt: skip
def test_anything_but_one_origin_is_refused_at_start(given):
    with pytest.raises(ValidationError, match="is not a web origin"):
        IngestSettings(cors_origins=[given])
