"""A chat template that passes the load-time probe can still spin on one request's
messages: the serving API renders off its event loop and under the time bound, so the
worker keeps answering other requests, and the spinning one is a 400 naming the bound."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch

from rtrl.checkpoint import Checkpoint
from rtrl.inference.config import InferenceSettings
from rtrl.inference.engine import Engine
from rtrl.inference.server import start
from rtrl.ops.tiny_model import CHATML, write_tiny_checkpoint
from rtrl.policy import state_dict_fp32
from support.wait import until_async

pytestmark = pytest.mark.integration

torch.set_num_threads(1)

# Two hundred million empty steps (tens of seconds of Jinja), only for one message's text:
# the probe's conversations pass, a request saying "spin" does not. Finite, so the same
# test run against a renderer without bounds ends, failing, instead of hanging.
SPIN_ON_REQUEST = (
    "{% if messages[-1]['content'] == 'spin' %}"
    "{% for i in range(100000) %}{% for j in range(2000) %}{% endfor %}{% endfor %}"
    "{% endif %}" + CHATML
)


@pytest.mark.guarantee(7)
def test_a_render_that_spins_is_bounded_and_the_worker_answers_meanwhile(
    stack_settings, tmp_path, monkeypatch
):
    monkeypatch.setenv("RTRL_CHAT_TEMPLATE_TIMEOUT_S", "5")
    model_dir = write_tiny_checkpoint(tmp_path / "spinner", "qwen3")
    (model_dir / "chat_template.jinja").write_text(SPIN_ON_REQUEST)
    weights = state_dict_fp32(Checkpoint.open(model_dir).load_model())
    stack = stack_settings.model_copy(update={"model_dir": model_dir})
    settings = InferenceSettings(
        http_port=0, follow_weights=False, max_tokens=4, auth_required=False
    )
    common = {"user_id": "u1", "session_id": "s1", "seed": 7}

    async def post(http, port: int, path: str, **body) -> tuple[int, dict]:
        async with http.post(f"http://127.0.0.1:{port}{path}", json=body) as resp:
            return resp.status, await resp.json()

    async def scenario() -> tuple[tuple[int, dict], tuple[int, dict]]:
        server = await start(stack, settings)
        try:
            assert isinstance(server.engine, Engine)  # the embedded backend
            for arm in ("control", "treatment"):
                server.engine.stage(arm, 0, weights)
            async with aiohttp.ClientSession() as http:
                spin = asyncio.ensure_future(
                    post(
                        http,
                        server.port,
                        "/v1/chat/completions",
                        messages=[{"role": "user", "content": "spin"}],
                        **common,
                    )
                )
                await until_async(
                    lambda: server.api.policy.renderer.in_flight,
                    "the spinning render under way",
                    timeout_s=60,
                )
                other = await post(http, server.port, "/v1/completions", prompt=[5, 6], **common)
                assert not spin.done(), "answered only once the spinning render had ended"
                return other, await asyncio.wait_for(spin, timeout=120)
        finally:
            await server.stop()

    (other_status, other), (spin_status, spun) = asyncio.run(scenario())
    assert other_status == 200, other
    assert spin_status == 400, spun
    assert spun["error"]["param"] == "messages"
    assert "RTRL_CHAT_TEMPLATE_TIMEOUT_S" in spun["error"]["message"]


@pytest.mark.guarantee(7)
def test_a_worker_refuses_to_start_on_a_template_that_loops(stack_settings, tmp_path, monkeypatch):
    from rtrl.checkpoint import CheckpointError

    monkeypatch.setenv("RTRL_CHAT_TEMPLATE_TIMEOUT_S", "1")
    model_dir = write_tiny_checkpoint(tmp_path / "looper", "qwen3")
    (model_dir / "chat_template.jinja").write_text(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}" + CHATML
    )
    stack = stack_settings.model_copy(update={"model_dir": model_dir})
    settings = InferenceSettings(http_port=0, follow_weights=False, auth_required=False)
    with pytest.raises(CheckpointError, match="chat_template.jinja.*RTRL_CHAT_TEMPLATE_TIMEOUT_S"):
        asyncio.run(start(stack, settings))
