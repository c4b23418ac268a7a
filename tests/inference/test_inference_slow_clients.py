"""The serving API closes connections that never finish a request (issue 24): headers cut
off, a body that stops arriving, an idle keep-alive connection; and serves everyone else
meanwhile. The deadlines are rtrl/http_limits.py's, set small here."""

from __future__ import annotations

import asyncio

import pytest

from rtrl.api_keys import COMPLETIONS, issue_key
from rtrl.inference.config import InferenceSettings
from rtrl.inference.engine import Engine, EngineConfig
from rtrl.inference.server import start
from support.signing import KEY_AUTHORITY
from support.slow_clients import (
    closes_every_stalled_connection,
    stalls,
)

pytestmark = pytest.mark.integration


@pytest.mark.guarantee(7)
def test_the_serving_api_closes_connections_that_never_finish_a_request(stack_settings):
    settings = InferenceSettings(
        http_port=0,
        follow_weights=False,
        http_header_timeout_s=1.0,
        http_body_timeout_s=1.0,
        http_keepalive_timeout_s=2.0,
    )

    async def scenario() -> None:
        server = await start(stack_settings, settings, engine=Engine(EngineConfig()))
        key = await issue_key(server.redis, KEY_AUTHORITY, "editor", scopes={COMPLETIONS})
        cases = stalls("/v1/completions", "/healthz", {"Authorization": f"Bearer {key}"})
        try:
            await closes_every_stalled_connection(server.port, cases, "the server")
        finally:
            await server.stop()

    asyncio.run(scenario())
