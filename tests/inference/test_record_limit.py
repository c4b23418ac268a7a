"""A rollout too large for the broker is recorded with its bulk out of band, and one
whose metadata alone is too large is served, not lost, and not recorded.

Kafka refuses records over its limit (about 1 MB by default), and a long agent trajectory
or a mixture-of-experts rollout (hundreds of bytes of routes per token) is larger. Its
bulk goes to the rollout store (rtrl/bulk.py) and the record that travels names it; what
still does not fit (a prompt as long as the context) is answered with ``not_recorded``
naming the limit, counted, and never produced. The limit leaves room for the reward that
carries the rollout: a rollout of the largest size recorded makes a reward that fits too.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch

from rtrl import bulk, kafka, topics
from rtrl.inference.config import InferenceSettings
from rtrl.inference.engine import Engine, EngineConfig
from rtrl.inference.server import start
from rtrl.policy import build_model, state_dict_fp32
from rtrl.reward_stream.config import RewardStreamSettings
from rtrl.reward_stream.runtime import Joiner
from rtrl.v1 import common_pb2, rollout_pb2
from support.inference import read_rollouts

torch.set_num_threads(1)

INLINE = 656
LIMIT = 64 * 1024 + INLINE
"""kafka_max_record_bytes: rollout records of up to 656 bytes travel."""


def metadata(chars: int) -> dict[str, str]:
    """``chars`` characters of travelling metadata, spread over the four fields a request
    sets (each at most 128: rtrl/field_bounds.py)."""
    fields = ("prompt_group_id", "context_key", "user_id", "session_id")
    assert chars <= 128 * len(fields)
    return {name: "m" * min(128, max(chars - 128 * i, 0)) or "m" for i, name in enumerate(fields)}


@pytest.mark.integration
def test_a_rollout_over_the_record_limit_goes_out_of_band_unless_its_metadata_is_over(
    stack_settings,
):
    stack = stack_settings.model_copy(update={"kafka_max_record_bytes": LIMIT})
    engine = Engine(EngineConfig(batch_wait_s=0.01))
    settings = InferenceSettings(http_port=0, follow_weights=False, auth_required=False)

    async def scenario() -> list[tuple[int, dict]]:
        server = await start(stack, settings, engine=engine)
        try:
            for arm in ("control", "treatment"):
                engine.stage(arm, 0, state_dict_fp32(build_model(seed=1)))
            url = f"http://127.0.0.1:{server.port}/v1/completions"
            answers = []
            async with aiohttp.ClientSession() as http:
                # A record is its metadata and 240-310 bytes more (the more under a longer
                # temporary directory, as pytest-xdist's workers have): 390, 495 without its
                # bulk (761 with it) and 793 bytes here, each ~95 bytes clear of the limit
                # either way. Travelling metadata is at most 4 x 128 characters.
                for prompt, max_tokens, chars in (
                    ("@p1 hi\n", 4, 150),
                    ("@p1 " + "x" * 60 + "\n", 60, 180),
                    ("@p1 hi\n", 4, 512),
                ):
                    body = {"prompt": prompt, "seed": 1, "max_tokens": max_tokens}
                    body |= metadata(chars)
                    async with http.post(url, json=body) as resp:
                        answers.append((resp.status, await resp.json()))
            counters = server.api.counters
            assert (counters.unrecorded, counters.records) == (1, 2)
            assert server.api.publisher.out_of_band == 1
            return answers
        finally:
            await server.stop()

    (small_status, small), (large_status, large), (meta_status, meta) = asyncio.run(scenario())
    assert (small_status, large_status, meta_status) == (200, 200, 200), (small, large, meta)
    assert "not_recorded" not in small and "not_recorded" not in large
    assert meta["usage"]["completion_tokens"] > 0  # served in full
    assert "without its bulk, over the 656 that leave room" in meta["not_recorded"]
    records = {r.rollout_id: r for r in read_rollouts(stack_settings)}
    assert set(records) == {small["rollout_id"], large["rollout_id"]}
    inline, out_of_band = records[small["rollout_id"]], records[large["rollout_id"]]
    assert not inline.HasField("bulk") and list(inline.completion_token_ids) == small["token_ids"]
    whole = bulk.inflate(out_of_band, bulk.BulkStore(stack.resolved_rollout_bulk_dir()))
    assert list(whole.completion_token_ids) == large["token_ids"]
    assert out_of_band.ByteSize() <= INLINE < whole.ByteSize()


def test_a_rollout_of_the_largest_recorded_size_makes_a_reward_under_the_limit():
    limit = 1_000_000
    largest = kafka.max_rollout_bytes(limit)
    record = rollout_pb2.RolloutRecord(
        event_id="r-r", rollout_id="r", client_ts_ms=1_800_000_000_000, arm=common_pb2.ARM_TREATMENT,
        completion_token_ids=[5, 6, 7], completion_logprobs=[-0.1, -0.2, -0.3],
    )  # fmt: skip
    record.completion_text = "x" * (largest - record.ByteSize() - 5)
    value = record.SerializeToString()
    assert largest - 8 <= len(value) <= largest
    joiner = Joiner(RewardStreamSettings(window_s=1, grace_s=0).join_config())
    joiner.feed_record(topics.ROLLOUT, 0, 0, b"r", value, 1_800_000_000_000)
    (reward,) = [r for r in joiner.tick(1_800_000_100_000) if r.topic == topics.REWARD]
    assert len(value) < len(reward.value) < limit
