"""``POST /v1/chat/completions`` on a worker serving a Hugging Face checkpoint (a tiny
random Qwen3 with a byte-level BPE tokenizer and ChatML), against a real broker and
Redis: the rollout record holds exactly the chat template's ids and the sampled ids,
token ids in are served as given, and what the template or vocabulary refuses is a 400
naming the field, with nothing recorded."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import torch

from rtrl.api_keys import COMPLETIONS, issue_key
from rtrl.checkpoint import Checkpoint
from rtrl.inference.config import InferenceSettings
from rtrl.inference.engine import Engine
from rtrl.inference.server import start
from rtrl.ops.tiny_model import write_tiny_checkpoint
from rtrl.policy import state_dict_fp32
from support.inference import read_rollouts
from support.signing import KEY_AUTHORITY

pytestmark = pytest.mark.integration

torch.set_num_threads(1)

MESSAGES = [
    {"role": "system", "content": "You edit code."},
    {"role": "user", "content": "Rename x to total: ü 🙂"},
]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3") / "tiny-qwen3", "qwen3")


async def _post(http, port: int, path: str, **body) -> tuple[int, dict]:
    async with http.post(f"http://127.0.0.1:{port}{path}", json=body) as resp:
        return resp.status, await resp.json()


def test_a_chat_record_holds_the_templates_ids_and_the_sampled_ids(stack_settings, qwen3_dir):
    policy = Checkpoint.open(qwen3_dir)
    weights = state_dict_fp32(policy.load_model())
    stack = stack_settings.model_copy(update={"model_dir": qwen3_dir})
    settings = InferenceSettings(
        http_port=0, follow_weights=False, max_tokens=12, auth_required=False
    )

    async def scenario() -> list[tuple[int, dict]]:
        server = await start(stack, settings)
        try:
            assert isinstance(server.engine, Engine)  # the embedded backend
            for arm in ("control", "treatment"):
                server.engine.stage(arm, 0, weights)
            common = {"user_id": "u1", "session_id": "s1", "seed": 7}
            async with aiohttp.ClientSession() as http:
                return [
                    await _post(
                        http, server.port, "/v1/chat/completions", messages=MESSAGES, **common
                    ),
                    await _post(http, server.port, "/v1/completions", prompt=[5, 6, 7], **common),
                    # Refused, each naming its field: a role the template does not know of
                    # in the allow-list, an empty chat, ids outside the vocabulary.
                    await _post(
                        http,
                        server.port,
                        "/v1/chat/completions",
                        messages=[{"role": "wizard", "content": "hi"}],
                        **common,
                    ),
                    await _post(http, server.port, "/v1/chat/completions", messages=[], **common),
                    await _post(http, server.port, "/v1/completions", prompt=[10**6], **common),
                ]
        finally:
            await server.stop()

    (chat_status, chat), (plain_status, plain), *refused = asyncio.run(scenario())
    assert (chat_status, plain_status) == (200, 200), (chat, plain)
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["role"] == "assistant"
    template_ids = policy.render_chat(MESSAGES)
    assert chat["prompt_token_ids"] == template_ids
    assert chat["choices"][0]["message"]["content"] == policy.decode(chat["token_ids"])
    assert plain["prompt_token_ids"] == [5, 6, 7]
    assert [status for status, _ in refused] == [400, 400, 400]
    assert [body["error"]["param"].split("[")[0].split(".")[0] for _, body in refused] == [
        "messages",
        "messages",
        "prompt",
    ]

    records = {r.rollout_id: r for r in read_rollouts(stack_settings)}
    assert set(records) == {chat["rollout_id"], plain["rollout_id"]}
    record = records[chat["rollout_id"]]
    # Exactly what the model saw and sampled: the template's ids, then the sampled ids.
    assert list(record.prompt_token_ids) == template_ids
    assert list(record.completion_token_ids) == chat["token_ids"]
    assert len(record.completion_logprobs) == len(chat["token_ids"])
    assert record.model_name == "tiny-qwen3"


@pytest.mark.guarantee(7)
def test_the_chat_route_is_behind_the_same_door_as_completions(stack_settings, qwen3_dir):
    """An attacker aiming at /v1/chat/completions instead of /v1/completions meets the same
    checks, in the same order: no key or an unknown one is 401, a key without the
    completions scope 403, a body over the key's budget 429 and over the server's bound
    413 (also when it comes chunked, with no Content-Length). Nothing refused reaches the
    engine or the rollout topic; the one keyed, well-formed chat does."""
    policy = Checkpoint.open(qwen3_dir)
    weights = state_dict_fp32(policy.load_model())
    stack = stack_settings.model_copy(update={"model_dir": qwen3_dir})
    settings = InferenceSettings(
        http_port=0, follow_weights=False, max_tokens=6, max_request_bytes=2048
    )
    common = {"messages": MESSAGES, "user_id": "u1", "session_id": "s1"}
    padded = {**common, "messages": [{"role": "user", "content": "x" * 300}]}
    oversize = {**common, "messages": [{"role": "user", "content": "x" * 3000}]}

    async def scenario() -> tuple[list[tuple[str, int, str]], dict]:
        server = await start(stack, settings)
        try:
            assert isinstance(server.engine, Engine)
            for arm in ("control", "treatment"):
                server.engine.stage(arm, 0, weights)
            keys = {
                "plain": await issue_key(server.redis, KEY_AUTHORITY, "chat", scopes={COMPLETIONS}),
                "events-only": await issue_key(
                    server.redis, KEY_AUTHORITY, "telemetry", scopes={"*"}
                ),
                "small": await issue_key(
                    server.redis,
                    KEY_AUTHORITY,
                    "small",
                    scopes={COMPLETIONS},
                    max_request_bytes=200,
                ),
            }
            url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
            attempts = (
                ("no key", None, common),
                ("made-up key", "rtrl_made-up", common),
                ("events-only key", keys["events-only"], common),
                ("over the key's budget", keys["small"], padded),
                ("over the server's bound", keys["plain"], oversize),
            )
            seen = []
            async with aiohttp.ClientSession() as http:
                for what, key, body in attempts:
                    headers = {"Authorization": f"Bearer {key}"} if key else {}
                    async with http.post(url, json=body, headers=headers) as resp:
                        seen.append((what, resp.status, (await resp.json())["error"]["message"]))

                async def chunked():
                    yield json.dumps(oversize).encode()

                headers = {"Authorization": f"Bearer {keys['plain']}"}
                async with http.post(url, data=chunked(), headers=headers) as resp:
                    seen.append(("chunked, over the bound", resp.status, await resp.text()))
                async with http.post(url, json=common, headers=headers) as resp:
                    assert resp.status == 200, await resp.text()
                    answer = await resp.json()
            assert server.door is not None and server.door.in_flight == {}
            return seen, answer
        finally:
            await server.stop()

    seen, answer = asyncio.run(scenario())
    assert [(what, status) for what, status, _ in seen] == [
        ("no key", 401),
        ("made-up key", 401),
        ("events-only key", 403),
        ("over the key's budget", 429),
        ("over the server's bound", 413),
        ("chunked, over the bound", 413),
    ]
    reasons = [reason for _, _, reason in seen]
    assert "missing API key" in reasons[0] and "unknown API key" in reasons[1]
    assert "may not ask for completions" in reasons[2]
    assert "budget of 200 bytes" in reasons[3] and "bound of 2048 bytes" in reasons[4]
    assert [r.rollout_id for r in read_rollouts(stack_settings)] == [answer["rollout_id"]]
