"""The gateway's HTTP API closes connections that never finish a request (issue 24): headers
cut off, a body that stops arriving, an idle keep-alive connection; and serves everyone
else meanwhile. The deadlines are rtrl/http_limits.py's, set small here."""

from __future__ import annotations

import asyncio

import pytest

from rtrl.api_keys import issue_key
from rtrl.ingest.server import start
from support.ingest import ingest_settings
from support.signing import KEY_AUTHORITY
from support.slow_clients import (
    closes_every_stalled_connection,
    stalls,
)

pytestmark = pytest.mark.integration


@pytest.mark.guarantee(7)
def test_the_gateway_closes_connections_that_never_finish_a_request(
    stack_settings, collect_kafka_clients
):
    settings = ingest_settings(
        auth_required=True,
        http_header_timeout_s=1.0,
        http_body_timeout_s=1.0,
        http_keepalive_timeout_s=2.0,
    )

    async def scenario() -> None:
        server = await start(stack_settings, settings)
        key = await issue_key(server.redis, KEY_AUTHORITY, "editor")
        cases = stalls("/v1/events", "/healthz", {"Authorization": f"Bearer {key}"})
        try:
            await closes_every_stalled_connection(settings.http_port, cases, "the gateway")
        finally:
            await server.stop()

    asyncio.run(scenario())
