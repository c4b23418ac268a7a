"""A 32k-token agent trajectory of 110 tool calls, written as a worker writes it, recorded
whole with its bulk out of band, joined and trained (rtrl/bulk.py).

A tiny model cannot be taught to play a hundred tool calls here (it memorizes a few dozen
and then babbles), so the trajectory is built the way the serving API builds one, turn by
turn: the policy's Hermes call and end token, then the tool's result as the chat template
renders it after the turn (inference/sessions.continuation_ids), its log-probs a forward
of the tiny model over the exact prefix. From there on it is the worker's own path: the
record the sessions write (records.trajectory_record), sealed and published by the
worker's RolloutPublisher to the broker; the joiner; the trainer's intake reading the bulk
back; a micro-batched step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
import redis.asyncio as aioredis
import torch

from rtrl import bulk, kafka, topics
from rtrl.checkpoint import Checkpoint
from rtrl.inference.batch import SequenceParams
from rtrl.inference.config import InferenceSettings
from rtrl.inference.recording import Record, RolloutPublisher
from rtrl.inference.records import RolloutContext, trajectory_record
from rtrl.inference.sessions import continuation_ids
from rtrl.ops.tiny_agent import Script, function_tool, write_tiny_agent
from rtrl.ops.tiny_model import EOS_ID
from rtrl.reward_stream.config import RewardStreamSettings
from rtrl.reward_stream.runtime import Joiner
from rtrl.trainer.batch import TrainSample, collate, to_sample
from rtrl.trainer.step import rl_step, token_logprobs
from rtrl.trajectory import Link, LinkReason, Segment, ToolCall, Trajectory
from rtrl.v1 import reward_pb2
from support.inference import read_rollouts

pytestmark = pytest.mark.integration

torch.set_num_threads(1)

CALLS = 110
READ = function_tool("read_file", "Read a file of the repository", path="the file's path")
OPENING = (
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Read every file, one by one."},
)
FILE = "".join(f"def f{i}(x):\n    return x * {i} + {i * i} - len(str(x))\n" for i in range(8))
"""What read_file answers: about 240 tokens of code."""


def call_text(turn: int) -> str:
    arguments = json.dumps({"path": f"src/f{turn}.py"})
    return f'<tool_call>\n{{"name": "read_file", "arguments": {arguments}}}\n</tool_call>'


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> Checkpoint:
    """A tiny Qwen3 with the agent tokens and a tool template, untaught (min_prob 0)."""
    out = tmp_path_factory.mktemp("long") / "tiny-agent"
    write_tiny_agent(
        out, [Script(OPENING, (("ok", ()),), (READ,))], max_positions=40960, min_prob=0
    )
    return Checkpoint.open(out)


def long_trajectory(policy: Checkpoint) -> Trajectory:
    """CALLS turns of one read_file call each, the first half sampled by version 3 and the
    rest by 4, each answered by FILE; log-probs from one forward over the whole row."""
    prompt = policy.render_chat(list(OPENING), [READ])
    turns, observations = [], []
    for turn in range(CALLS):
        turns.append([*policy.tokenize(call_text(turn)), EOS_ID])
        if turn < CALLS - 1:
            tool = {"role": "tool", "tool_call_id": f"call_{turn}", "content": FILE}
            observations.append(continuation_ids(policy, EOS_ID, [tool], [READ]))
    ids = [
        *prompt,
        *(
            t
            for pair in zip(turns, [*observations, []], strict=True)
            for part in pair
            for t in part
        ),
    ]
    with torch.inference_mode():
        logits = policy.load_model()(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    segments, at = [], len(prompt)
    for turn, generated in enumerate(turns):
        scores = logp[at - 1 : at - 1 + len(generated)].tolist()
        segments.append(
            Segment.generated(generated, scores, [3 if turn < CALLS // 2 else 4] * len(generated))
        )
        at += len(generated)
        if turn < CALLS - 1:
            segments.append(Segment.observed(observations[turn], "tool"))
            at += len(observations[turn])
    return Trajectory(
        prompt_ids=tuple(prompt),
        segments=tuple(segments),
        final_text=call_text(CALLS - 1),
        tool_calls=tuple(
            ToolCall(
                "read_file", json.dumps({"path": f"src/f{t}.py"}), True, id=f"call_{t}", turn=t
            )
            for t in range(CALLS)
        ),
        prompt_text=policy.decode(prompt),
        finish_reason="tool_calls",
        link=Link("long-1", 0, True, LinkReason.FIRST),
    )


def publish(stack, record) -> Record:
    """The worker's write: sealed (out of band past the inline limit), acked by the broker."""
    settings = InferenceSettings()
    seal = settings.rollout_seal()

    async def write() -> Record:
        producer = kafka.AsyncProducer(stack)
        redis = aioredis.Redis.from_url(stack.redis_url)
        publisher = RolloutPublisher(
            producer,
            seal,
            redis,
            bulk.BulkStore(stack.resolved_rollout_bulk_dir()),
            max_record_bytes=stack.kafka_max_record_bytes,
            inline_bytes=settings.rollout_inline_bytes,
            served_ttl_s=60,
        )
        try:
            sealed = await publisher.seal(record)
            assert isinstance(sealed, Record) and publisher.out_of_band == 1, sealed
            await publisher.publish(record.rollout_id, sealed, None, "")
            return sealed
        finally:
            producer.close()
            await redis.aclose()

    return asyncio.run(write())


def test_a_32k_trajectory_of_110_tool_calls_is_recorded_whole_joined_and_trained(
    stack_settings, policy
):
    trajectory = long_trajectory(policy)
    tokens = len(trajectory.prompt_ids) + sum(len(s.token_ids) for s in trajectory.segments)
    assert tokens >= 32_000 and len(trajectory.tool_calls) == CALLS
    context = RolloutContext(
        rollout_id="long-1", session_id="s", user_id="u", client_ts_ms=1_800_000_000_000,
        worker_id="inference-0", model_name="tiny-agent", prompt_text=trajectory.prompt_text,
    )  # fmt: skip
    params = SequenceParams(trajectory.prompt_ids, 64, 1.0, 1.0, 0)
    written = trajectory_record(
        context, trajectory, arm="treatment", params=params, latency_s=60.0, ttft_s=0.1
    )
    # A broker limit that leaves rollouts 16 KiB (a tiny vocabulary's ids take a byte or
    # two; a real model's 32k tokens are a few hundred KB of ids, log-probs and text).
    stack = stack_settings.model_copy(update={"kafka_max_record_bytes": 80 * 1024})
    assert written.ByteSize() > 4 * kafka.max_rollout_bytes(stack.kafka_max_record_bytes)
    publish(stack, written)

    (record,) = read_rollouts(stack_settings)
    assert record.HasField("bulk") and record.ByteSize() < 1_000
    assert (record.bulk.prompt_tokens, record.bulk.turns) == (len(trajectory.prompt_ids), CALLS)
    store = bulk.BulkStore(stack_settings.resolved_rollout_bulk_dir())
    assert Trajectory.of(bulk.inflate(record, store)) == trajectory  # whole: nothing truncated

    # The joiner holds and forwards the small record; the reward names the bulk.
    joiner = Joiner(RewardStreamSettings(window_s=1, grace_s=0).join_config())
    now = record.client_ts_ms + 5_000
    value = record.SerializeToString()
    joiner.feed_record(topics.ROLLOUT, 0, 0, record.rollout_id.encode(), value, now)
    (out,) = [r for r in joiner.tick(now + 60_000) if r.topic == topics.REWARD]
    reward = reward_pb2.RewardRecord.FromString(out.value)
    assert len(out.value) < 2_000 and reward.rollout.bulk.checksum == record.bulk.checksum
    assert reward.components.tool_call_validity == 1.0

    # The trainer reads the bulk back, trains every generated token, in micro-batches.
    reward.rollout.CopyFrom(bulk.inflate(reward.rollout, store))
    sample = to_sample(reward, policy.max_positions, vocab_size=policy.spec.vocab_size)
    assert isinstance(sample, TrainSample), sample
    batch = dataclasses.replace(collate([sample]), advantages=(1.0,))  # alone: no baseline
    assert batch.target_mask.sum().item() == len(trajectory.generated_ids)
    model = policy.load_model()
    before = token_logprobs(model, batch)[0].detach()
    mask = batch.target_mask > 0
    assert torch.allclose(before[mask], batch.behaviour_logprobs[mask], atol=1e-4)
    rl_step(model, torch.optim.SGD(model.parameters(), lr=0.05), batch, token_budget=8192)
    after = token_logprobs(model, batch)[0].detach()
    assert (after - before)[mask].sum() > 0  # the trajectory's tokens made likelier
