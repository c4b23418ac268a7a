"""M2: every client-supplied string the serving API copies onward (into the rollout record,
its reward and the analytics sink) has a bound at the door. A prompt_group_id was bounded
only by the 256 KiB body, and one key grew the broker by 6.4 MB/s through it; now each
travelling field over its bound (rtrl/field_bounds.py) is a 400 naming the field, with
nothing recorded, and one at its bound is served and recorded whole."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch

from rtrl.field_bounds import MAX_ID_CHARS
from rtrl.inference.config import InferenceSettings
from rtrl.inference.engine import Engine, EngineConfig
from rtrl.inference.server import start
from rtrl.policy import build_model, state_dict_fp32
from support.inference import read_rollouts

pytestmark = pytest.mark.integration

torch.set_num_threads(1)

AT_THE_BOUND = {
    "prompt_group_id": "g:repo/a@b_c.d-" + "x" * 113,  # 128 characters
    "user_id": "u" * MAX_ID_CHARS,
    "session_id": "s" * MAX_ID_CHARS,
}
HOSTILE = [
    ("prompt_group_id", "g" * 256 * 1024),  # the attack: the whole body in one group id
    ("prompt_group_id", "g" * 129),
    ("prompt_group_id", "group\nx-injected: 1"),
    ("prompt_group_id", "groupé"),
    ("user_id", "u" * (MAX_ID_CHARS + 1)),
    ("user", "u" * (MAX_ID_CHARS + 1)),
    ("session_id", "s" * (MAX_ID_CHARS + 1)),
]


@pytest.mark.guarantee(7)
def test_m2_travelling_strings_over_their_bound_are_refused_at_the_serving_api(stack_settings):
    """M2: prompt_group_id, user ids and session ids over their bound: 400 naming the
    field, nothing recorded; at the bound: served and recorded as sent."""
    settings = InferenceSettings(
        http_port=0,
        follow_weights=False,
        max_tokens=4,
        auth_required=False,
        max_request_bytes=512 * 1024,
    )
    base = {"prompt": "@p1 say hi\n", "seed": 3}

    async def scenario() -> tuple[dict, list[tuple[str, int, dict]]]:
        engine = Engine(EngineConfig())
        server = await start(stack_settings, settings, engine=engine)
        try:
            for arm in ("control", "treatment"):
                engine.stage(arm, 0, state_dict_fp32(build_model(seed=1)))
            url = f"http://127.0.0.1:{server.port}/v1/completions"
            refused = []
            async with aiohttp.ClientSession() as http:
                async with http.post(url, json={**base, **AT_THE_BOUND}) as resp:
                    assert resp.status == 200, await resp.text()
                    served = await resp.json()
                for field, value in HOSTILE:
                    body = {**base, **AT_THE_BOUND, field: value}
                    async with http.post(url, json=body) as resp:
                        refused.append((field, resp.status, await resp.json()))
            return served, refused
        finally:
            await server.stop()

    served, refused = asyncio.run(scenario())
    assert [(status, body["error"]["param"]) for _, status, body in refused] == [
        (400, field) for field, _ in HOSTILE
    ]
    records = {r.rollout_id: r for r in read_rollouts(stack_settings)}
    assert list(records) == [served["rollout_id"]]  # nothing refused was recorded
    record = records[served["rollout_id"]]
    assert (record.prompt_group_id, record.user_id, record.session_id) == (
        AT_THE_BOUND["prompt_group_id"],
        AT_THE_BOUND["user_id"],
        AT_THE_BOUND["session_id"],
    )
