"""A key made by `rtrl keys create` with no budget flags is one client's, not the whole
server's: a flood of completions on it is refused past its budget at the door, and
another client's key is still served."""

import asyncio
from collections import Counter

import aiohttp
import pytest
import torch

from rtrl.inference.config import InferenceSettings
from rtrl.inference.engine import Engine, EngineConfig
from rtrl.inference.server import start
from rtrl.policy import build_model, state_dict_fp32
from support import wait
from support.keys import create_key

pytestmark = pytest.mark.integration

torch.set_num_threads(1)

FLOOD = 24
"""Completions fired at once on one key: far past what one editor keeps in flight."""


async def ask(http: aiohttp.ClientSession, port: int, key: str) -> tuple[int, str, str | None]:
    """Status, error (if any) and Retry-After of one completion."""
    body = {"prompt": "@p1 say hi\n", "user_id": "u", "session_id": "s", "max_tokens": 4}
    async with http.post(
        f"http://127.0.0.1:{port}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
    ) as resp:
        answer = await resp.json()
        return (
            resp.status,
            answer.get("error", {}).get("message", ""),
            resp.headers.get("Retry-After"),
        )


@pytest.mark.guarantee(7)
def test_a_flood_on_a_key_created_without_budget_flags_is_refused_while_another_key_is_served(
    stack_settings, tmp_path
):
    no_stack = tmp_path / "no-stack"  # the CLI finds no stack there and uses RTRL_REDIS_URL
    flooder = create_key(stack_settings.redis_url, no_stack, "editor-a", "--events", "completions")
    neighbour = create_key(
        stack_settings.redis_url, no_stack, "editor-b", "--events", "completions"
    )
    engine = Engine(EngineConfig(batch_wait_s=0.01))
    settings = InferenceSettings(http_port=0, follow_weights=False, ready_timeout_s=60)

    async def scenario() -> tuple[list[tuple[int, str, str | None]], int]:
        server = await start(stack_settings, settings, engine=engine)
        door = server.door
        try:
            async with aiohttp.ClientSession() as http:
                # No weights staged yet: every completion admitted waits in flight, so the
                # flood is wholly in flight at once, however fast the engine.
                flood = [
                    asyncio.ensure_future(ask(http, server.port, flooder.key)) for _ in range(FLOOD)
                ]
                await wait.until_async(
                    lambda: sum(f.done() for f in flood) + door.in_flight[flooder.digest] == FLOOD,
                    "every completion of the flood admitted or refused",
                )
                served = asyncio.ensure_future(ask(http, server.port, neighbour.key))
                await wait.until_async(
                    lambda: door.in_flight[neighbour.digest] or served.done(),
                    "the neighbour's completion admitted",
                )
                engine.stage("control", 0, state_dict_fp32(build_model(seed=1)))
                engine.stage("treatment", 0, state_dict_fp32(build_model(seed=1)))
                return list(await asyncio.gather(*flood)), (await served)[0]
        finally:
            await server.stop()

    flood, neighbour_status = asyncio.run(scenario())
    statuses = Counter(status for status, _, _ in flood)
    admitted = int(flooder.record["max_concurrency"])
    assert statuses[429] == FLOOD - admitted and 0 < admitted < FLOOD, (
        f"{FLOOD} completions at once on one key: {dict(statuses)}, its record: {flooder.record}"
    )
    assert statuses[200] == admitted
    refusals = [(error, retry) for status, error, retry in flood if status == 429]
    assert all("in flight" in error and int(retry or 0) >= 1 for error, retry in refusals), (
        refusals[:3]
    )
    assert neighbour_status == 200
