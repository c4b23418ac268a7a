"""A request's ``context_key`` (the product's task type, repository...) against a real broker
and Redis: it lands in the rollout record the trainer's context baseline reads, and one
outside the allow-list (ASCII letters, digits, ``._:/@-``, at most 128) is a 400 naming the
field, with nothing recorded."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
import torch

from rtrl.inference.config import InferenceSettings
from rtrl.inference.engine import Engine, EngineConfig
from rtrl.inference.server import start
from rtrl.policy import build_model, state_dict_fp32
from support.inference import read_rollouts

pytestmark = pytest.mark.integration

torch.set_num_threads(1)

ACCEPTED: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "@p1 say hi\n", "context_key": "repo:acme/api@main"},
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "say hi"}],
        "context_key": "task.rename_-" + "x" * 115,  # 128 characters: the longest taken
    },
}
HOSTILE = [
    "x" * 129,
    "repo:acme\nx-injected: 1",
    "repé",
    "task rename",
    "repo:acme/api\n",
]


def test_context_key_is_recorded_and_a_hostile_one_refused(stack_settings):
    settings = InferenceSettings(
        http_port=0, follow_weights=False, max_tokens=6, auth_required=False
    )
    common = {"user_id": "u1", "session_id": "s1", "seed": 3}

    async def scenario() -> tuple[dict[str, dict], list[tuple[int, dict]]]:
        engine = Engine(EngineConfig())
        server = await start(stack_settings, settings, engine=engine)
        try:
            for arm in ("control", "treatment"):
                engine.stage(arm, 0, state_dict_fp32(build_model(seed=1)))
            url = f"http://127.0.0.1:{server.port}"
            answers, refused = {}, []
            async with aiohttp.ClientSession() as http:
                for path, body in ACCEPTED.items():
                    async with http.post(url + path, json={**common, **body}) as resp:
                        assert resp.status == 200, await resp.text()
                        answers[path] = await resp.json()
                for path in ACCEPTED:
                    for context_key in HOSTILE:
                        body = {**common, **ACCEPTED[path], "context_key": context_key}
                        async with http.post(url + path, json=body) as resp:
                            refused.append((resp.status, await resp.json()))
            return answers, refused
        finally:
            await server.stop()

    answers, refused = asyncio.run(scenario())
    assert [(status, body["error"]["param"]) for status, body in refused] == [
        (400, "context_key")
    ] * (len(ACCEPTED) * len(HOSTILE))
    records = {r.rollout_id: r for r in read_rollouts(stack_settings)}
    assert {
        path: records[answer["rollout_id"]].context_key for path, answer in answers.items()
    } == {path: body["context_key"] for path, body in ACCEPTED.items()}
    assert len(records) == len(ACCEPTED)  # nothing refused was recorded
