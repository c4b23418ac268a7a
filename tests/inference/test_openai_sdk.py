"""The serving API through the official OpenAI Python SDK, as an agent team points it at
its base URL: nothing but what OpenAI's API takes is sent (no rtrl field), and what it
answers, errors included, is what the SDK understands. A worker serving a tiny random
Qwen3 checkpoint, with API keys required, against a real broker and Redis."""

from __future__ import annotations

import asyncio

import openai
import pytest
import torch
from openai.types.chat import ChatCompletionMessageParam

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

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You edit code."},
    {"role": "user", "content": "Rename x to total."},
]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3") / "tiny-qwen3", "qwen3")


def test_an_openai_client_is_served_as_it_is(stack_settings, qwen3_dir):
    policy = Checkpoint.open(qwen3_dir)
    weights = state_dict_fp32(policy.load_model())
    stack = stack_settings.model_copy(update={"model_dir": qwen3_dir})
    settings = InferenceSettings(http_port=0, follow_weights=False, max_tokens=8)

    async def scenario():
        server = await start(stack, settings)
        try:
            assert isinstance(server.engine, Engine)
            for arm in ("control", "treatment"):
                server.engine.stage(arm, 0, weights)
            key = await issue_key(server.redis, KEY_AUTHORITY, "editor", scopes={COMPLETIONS})
            base_url = f"http://127.0.0.1:{server.port}/v1"
            client = openai.AsyncOpenAI(api_key=key, base_url=base_url, max_retries=0)
            models = [m async for m in client.models.list()]
            retrieved = await client.models.retrieve(models[0].id)
            plain = await client.chat.completions.create(
                model="whatever-the-agent-names", messages=MESSAGES, seed=7
            )
            for_alice = await client.chat.completions.create(
                model=models[0].id, messages=MESSAGES, seed=7, user="alice"
            )
            streamed = await client.chat.completions.create(
                model=models[0].id, messages=MESSAGES, seed=7, stream=True
            )
            chunks = [chunk async for chunk in streamed]
            async with client.chat.completions.stream(
                model=models[0].id, messages=MESSAGES, seed=7
            ) as helper:
                try:
                    accumulated = await helper.get_final_completion()
                except openai.LengthFinishReasonError as exc:  # at max_tokens: still whole
                    accumulated = exc.completion  # type: ignore[assignment]
            errors: list[openai.APIStatusError] = []
            wizard = [{"role": "wizard", "content": "hi"}]
            for bad in (
                client.chat.completions.create(model="m", messages=wizard),  # type: ignore[arg-type]
                client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=0),
            ):
                try:
                    await bad
                except openai.BadRequestError as exc:
                    errors.append(exc)
            stranger = openai.AsyncOpenAI(api_key="not-a-key", base_url=base_url, max_retries=0)
            for refused in (
                stranger.chat.completions.create(model="m", messages=MESSAGES),
                stranger.models.list(),  # the model list is behind the same door
            ):
                try:
                    await refused
                except openai.AuthenticationError as exc:
                    errors.append(exc)
            streams = (chunks, accumulated)
            return models, retrieved, plain, for_alice, streams, errors, server.api.model_name
        finally:
            await server.stop()

    models, retrieved, plain, for_alice, (chunks, accumulated), errors, served = asyncio.run(
        scenario()
    )
    assert [(m.id, m.object, m.owned_by) for m in models] == [(served, "model", "rtrl")]
    assert retrieved.id == served
    for answer in (plain, for_alice):
        assert answer.object == "chat.completion" and answer.model == served
        (choice,) = answer.choices
        assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
        assert choice.message.content == policy.decode(answer.model_extra["token_ids"])
        assert answer.usage.completion_tokens == len(answer.model_extra["token_ids"])
    # Streamed: chat.completion.chunk deltas, the role once, each chunk with its token; the
    # SDK's own accumulating helper reads the same turn.
    assert {(c.id, c.object) for c in chunks} == {(chunks[0].id, "chat.completion.chunk")}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    token_ids = chunks[-1].model_extra["token_ids"]
    assert [c.model_extra["token_id"] for c in chunks[:-1]] == token_ids
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == policy.decode(token_ids)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    # The same request again (the same seed, user and weights: the same tokens).
    assert accumulated.choices[0].message.content == content
    # Each error as the SDK raises it, the field at fault in OpenAI's notation.
    assert [(type(e).__name__, e.status_code, e.type, e.param, e.code) for e in errors] == [
        ("BadRequestError", 400, "invalid_request_error", "messages[0].role", None),
        ("BadRequestError", 400, "invalid_request_error", "max_tokens", None),
        ("AuthenticationError", 401, "authentication_error", None, "invalid_api_key"),
        ("AuthenticationError", 401, "authentication_error", None, "invalid_api_key"),
    ]
    # Recorded: the chat template's ids and the sampled ones; the end user is OpenAI's
    # `user` when the client names one, else the API key's client.
    records = {r.rollout_id: r for r in read_rollouts(stack_settings)}
    template_ids = policy.render_chat(MESSAGES)
    for answer, user in ((plain, "editor"), (for_alice, "alice")):
        record = records[answer.model_extra["rollout_id"]]
        assert (record.user_id, record.client_id) == (user, "editor")
        assert list(record.prompt_token_ids) == template_ids
        assert list(record.completion_token_ids) == answer.model_extra["token_ids"]
