"""L9: what a request leaves in Redis expires with the window that needs it.

On e9251e0 each completion left ~330 B (its "served to" mark) for 7 days, though the mark
is read only while the client's telemetry can still change a reward: the joiner's longest
wait for a record (RTRL_REWARD_MAX_WAIT_S, 3,960 s), after which an event joins nothing.
Here a keyed client is served completions and a trajectory, and sends events through the
gateway; then every key in Redis is either the stack's own (key records, heartbeats,
counters) or a per-request key with a TTL no longer than its documented window."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import redis.asyncio as aioredis
import torch

from rtrl.api_keys import issue_key
from rtrl.checkpoint import Checkpoint
from rtrl.inference.config import InferenceSettings
from rtrl.inference.server import start
from rtrl.ingest.config import IngestSettings
from rtrl.ingest.server import start as start_gateway
from rtrl.key_budgets import ONE_CLIENT
from rtrl.ops.tiny_model import write_tiny_checkpoint
from rtrl.policy import state_dict_fp32
from rtrl.reward_stream.config import RewardStreamSettings
from rtrl_client.client import make_event
from rtrl_client.v1 import telemetry_pb2
from support.ingest import ingest_settings
from support.signing import KEY_AUTHORITY

pytestmark = pytest.mark.integration

torch.set_num_threads(1)

HOUR = 3600
# Per-request key prefix -> the longest TTL it may have: its documented window.
WINDOWS = {
    # RTRL_INFERENCE_SERVED_TTL_S: the joiner's longest wait (3,960 s) rounded up to 2 h.
    "rtrl:served:": 2 * HOUR,
    # RTRL_INGEST_DEDUP_TTL_S: how long an SDK may resend an event (24 h).
    "rtrl:ingest:event:": 24 * HOUR,
    # A trajectory's owner: RTRL_INFERENCE_TRAJECTORY_IDLE_S (300 s) and a minute.
    "rtrl:trajectory:": 360,
    # A key's rate buckets: the time to refill a burst (60 / 20 per s) and a second.
    "rtrl:ingest:bucket:": 4,
}
# The stack's own keys, which live as long as what they describe, not a request.
NOT_PER_REQUEST = ("rtrl:ingest:key:", "rtrl:ingest:client:", "rtrl:hb:", "rtrl:applied:",
                   "rtrl:privacy:", "rtrl:ingest:private-users", "rtrl:ingest:inflight", "rtrl:ws:")  # fmt: skip


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3") / "tiny-qwen3", "qwen3")


@pytest.mark.guarantee(7)
def test_l9_every_per_request_key_in_redis_expires_within_its_window(stack_settings, qwen3_dir):
    """L9: after completions, a trajectory and events, every per-request Redis key has a
    TTL in (0, its window]; nothing else was written."""
    policy = Checkpoint.open(qwen3_dir)
    weights = state_dict_fp32(policy.load_model())
    stack = stack_settings.model_copy(update={"model_dir": qwen3_dir})
    settings = InferenceSettings(http_port=0, follow_weights=False, max_tokens=4)
    gateway_settings: IngestSettings = ingest_settings(auth_required=True)

    async def scenario() -> dict[str, int]:
        redis = aioredis.Redis.from_url(stack.redis_url)
        server = await start(stack, settings)
        gateway = await start_gateway(stack, gateway_settings)
        try:
            for arm in ("control", "treatment"):
                server.engine.stage(arm, 0, weights)  # type: ignore[union-attr]
            key = await issue_key(
                redis, KEY_AUTHORITY, "editor", {"*", "completions"},
                rate_per_s=ONE_CLIENT.rate_per_s, burst=ONE_CLIENT.burst,
            )  # fmt: skip
            headers = {"Authorization": f"Bearer {key}"}
            url = f"http://127.0.0.1:{server.port}"
            turn = {"messages": [{"role": "user", "content": "hi"}], "seed": 1}
            rollouts = []
            async with aiohttp.ClientSession(headers=headers) as http:
                for body in (
                    {"prompt": [5, 6, 7], "seed": 1},
                    turn,
                    {**turn, "trajectory_id": "agent-1"},
                ):
                    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
                    async with http.post(url + path, json=body) as resp:
                        assert resp.status == 200, await resp.text()
                        rollouts.append((await resp.json())["rollout_id"])
                events = [
                    make_event(r, "s1", "u1", edit_shown=telemetry_pb2.EditShown(
                        file_path="a.py", edit_text="x = 1\n")) for r in rollouts
                ]  # fmt: skip
                body = {"events": [_json(e) for e in events]}
                gateway_url = f"http://127.0.0.1:{gateway_settings.http_port}/v1/events"
                async with http.post(gateway_url, json=body) as resp:
                    assert resp.status == 200, await resp.text()
            ttls = {}
            async for name in redis.scan_iter(match="rtrl:*"):
                ttls[name.decode()] = await redis.ttl(name)
            return ttls
        finally:
            await gateway.stop()
            await server.stop()
            await redis.aclose()

    ttls = asyncio.run(scenario())
    per_request = {name: ttl for name, ttl in ttls.items() if not name.startswith(NOT_PER_REQUEST)}
    written = {p for p in WINDOWS if any(n.startswith(p) for n in per_request)}
    assert written == set(WINDOWS), per_request  # every kind was written
    for name, ttl in per_request.items():
        window = next((w for p, w in WINDOWS.items() if name.startswith(p)), None)
        assert window is not None, f"{name}: a per-request key with no documented window"
        assert 0 < ttl <= window, f"{name}: TTL {ttl} s, its window {window} s"
    assert RewardStreamSettings().max_wait_s <= WINDOWS["rtrl:served:"]


def _json(event: telemetry_pb2.TelemetryEvent) -> dict:
    from google.protobuf import json_format

    return json_format.MessageToDict(event)
