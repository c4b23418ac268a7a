"""JSON nested past its bound is a 400 at the serving API, not a 500 (guarantee 7, issue
37's L4): a request's tool-call arguments (JSON inside a string, which pydantic's parser of
the body never sees) and a body nested past pydantic's own limit; and a tool call a model
wrote that deep is an invalid call, never an exception in the stream."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import torch

from rtrl.api_keys import COMPLETIONS, issue_key
from rtrl.bounded_json import MAX_JSON_DEPTH
from rtrl.checkpoint import Checkpoint
from rtrl.inference import tool_calls
from rtrl.inference.config import InferenceSettings
from rtrl.inference.engine import Engine
from rtrl.inference.server import start
from rtrl.ops.tiny_model import write_tiny_checkpoint
from rtrl.policy import state_dict_fp32
from support.signing import KEY_AUTHORITY

torch.set_num_threads(1)

DEEP = 100_000


def _nested(depth: int) -> str:
    """An object ``depth`` levels deep (an array inside, past the first: 2 bytes a level)."""
    return '{"a": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"


def _with_arguments(arguments: str) -> dict:
    return {
        "messages": [
            {"role": "user", "content": "read a.py"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call-1",
                        "type": "function",
                        "function": {"name": "read_file", "arguments": arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call-1", "content": "x = 1"},
        ],
        "user_id": "u1",
        "session_id": "s1",
    }


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3") / "tiny-qwen3", "qwen3")


@pytest.mark.integration
@pytest.mark.guarantee(7)
def test_deep_json_in_a_request_is_a_400_naming_the_field(stack_settings, qwen3_dir):
    """L4: 100k-deep tool-call arguments were a 500 (RecursionError in json.loads); they are
    a 400 naming the arguments, as is a body nested past the parser's limit, and the worker
    serves the next request."""
    policy = Checkpoint.open(qwen3_dir)
    weights = state_dict_fp32(policy.load_model())
    stack = stack_settings.model_copy(update={"model_dir": qwen3_dir})
    settings = InferenceSettings(http_port=0, follow_weights=False, max_tokens=4)
    deep_body = '{"messages": ' + "[" * DEEP + "]" * DEEP + "}"

    async def scenario() -> list[tuple[str, int, dict]]:
        server = await start(stack, settings)
        try:
            assert isinstance(server.engine, Engine)
            for arm in ("control", "treatment"):
                server.engine.stage(arm, 0, weights)
            key = await issue_key(server.redis, KEY_AUTHORITY, "deep", scopes={COMPLETIONS})
            url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
            headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
            bodies = (
                ("deep arguments", json.dumps(_with_arguments(_nested(DEEP)))),
                (
                    "arguments one past the bound",
                    json.dumps(_with_arguments(_nested(MAX_JSON_DEPTH + 1))),
                ),
                ("a deep body", deep_body),
                ("arguments at the bound", json.dumps(_with_arguments(_nested(MAX_JSON_DEPTH)))),
            )
            answers = []
            async with aiohttp.ClientSession() as http:
                for name, body in bodies:
                    async with http.post(url, data=body, headers=headers) as response:
                        answers.append((name, response.status, await response.json()))
            return answers
        finally:
            await server.stop()

    answers = asyncio.run(scenario())
    for name, status, body in answers[:3]:
        assert status == 400, (name, status, body)
        assert "nest" in body["error"]["message"] or "recursion" in body["error"]["message"], body
    assert answers[0][2]["error"]["param"].endswith("arguments"), answers[0]
    name, status, body = answers[3]
    assert status == 200, (name, status, body)


@pytest.mark.guarantee(7)
@pytest.mark.parametrize("family", ["hermes", "bang"])
def test_a_tool_call_a_model_nested_past_the_bound_is_an_invalid_call(family):
    """L4: a model that writes a call nested 100k deep gets an invalid call with the reason,
    like any broken JSON, not a RecursionError in the middle of its stream."""
    arguments = _nested(DEEP)
    if family == "hermes":
        text = f'<tool_call>\n{{"name": "read_file", "arguments": {arguments}}}\n</tool_call>'
        parser: tool_calls.StreamingParser | tool_calls.BangParser = tool_calls.StreamingParser(
            {"read_file"}
        )
    else:
        text = f"!read_file {arguments}\n"
        parser = tool_calls.BangParser({"read_file"})
    events = parser.feed(text) + parser.finish()
    calls = [e.call for e in events if isinstance(e, tool_calls.Call)]
    assert len(calls) == 1 and not calls[0].valid
    assert "nested" in calls[0].error, calls[0].error
