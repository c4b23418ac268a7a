"""Router replay: the trainer's forward of a MoE policy, routed as the sampler routed,
gives the sampler's log-probs; re-routed, near-tied experts flip and the log-probs move.

The sampler is what a serving worker does: a prefill, then one token at a time on the
KV cache, recording its routes (rtrl.moe.record_routes) and each token's log-prob. The
rollouts travel as RewardRecord bytes, become TrainSamples and a padded TrainBatch, and
the trainer scores them with its own forward (trainer.step.token_logprobs), same weights,
same float32.

That alone leaves little to replay: an incremental decode and a full-sequence forward
differ by ~1e-7 in the router's logits, and a random router's top-k is rarely that close
to a tie. So the cases make some experts near-indistinguishable to the router (their rows
equal to 3e-9): which of them wins is then decided by rounding, as it is for the many
near-tied experts of a large MoE served in bfloat16. An untouched checkpoint is a case
too: nothing flips, and replay changes nothing.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from rtrl.moe import pack_routes, record_routes, routers
from rtrl.ops.tiny_model import write_tiny_checkpoint
from rtrl.trainer.batch import TrainBatch, TrainSample, collate, to_sample
from rtrl.trainer.config import TrainerSettings
from rtrl.trainer.distributed import shard, sharded_rl_step
from rtrl.trainer.learner import LocalLearner
from rtrl.trainer.router_replay import replaying
from rtrl.trainer.step import build_optimizer, token_logprobs
from rtrl.v1 import common_pb2, reward_pb2, rollout_pb2
from support.moe import one_rank_group, tie_experts

TEMPERATURE = 0.8
PROMPTS = ((12, 40), (7, 30))
"""(prompt tokens, completion tokens) of the batch's two rollouts: rows of unequal length."""

CASES = {
    # four of eight experts the router barely tells apart: many near-ties
    "qwen3_moe-4-tied": ("qwen3_moe", 4),
    # two of Mixtral's four
    "mixtral-2-tied": ("mixtral", 2),
    # the checkpoint as written: no near-tie, nothing for replay to remove
    "qwen3_moe-untouched": ("qwen3_moe", 0),
}


@dataclass(frozen=True)
class Policy:
    model: PreTrainedModel
    tied: int
    """Experts per layer made near-indistinguishable to the router (0: none)."""


@pytest.fixture(scope="module", params=sorted(CASES))
def policy(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Policy:
    family, tied = CASES[request.param]
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(family) / "model", family, seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tie_experts(model, tied)
    return Policy(model, tied)


@dataclass(frozen=True)
class Sampled:
    prompt: list[int]
    completion: list[int]
    logprobs: list[float]
    routes: torch.Tensor
    """[prompt + completion − 1, layers, top_k]: every position the sampler ran."""


@torch.no_grad()
def sample(model: PreTrainedModel, prompt: list[int], new_tokens: int, seed: int) -> Sampled:
    """A serving worker's decode: prefill, then one token at a time on the KV cache."""
    generator = torch.Generator().manual_seed(seed)
    completion: list[int] = []
    logprobs: list[float] = []
    step_input, cache = torch.tensor([prompt]), None
    with record_routes(model) as log:
        for _ in range(new_tokens):
            out = model(input_ids=step_input, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logp = torch.log_softmax(out.logits[0, -1].float() / TEMPERATURE, dim=-1)
            token = int(torch.multinomial(logp.exp(), 1, generator=generator))
            completion.append(token)
            logprobs.append(float(logp[token]))
            step_input = torch.tensor([[token]])
    return Sampled(prompt, completion, logprobs, log.stacked())


def reward_record(model: PreTrainedModel, sampled: Sampled, rollout_id: str) -> bytes:
    """The rollout as the trainer reads it off the reward topic."""
    rollout = rollout_pb2.RolloutRecord(
        rollout_id=rollout_id,
        arm=common_pb2.ARM_TREATMENT,
        prompt_token_ids=sampled.prompt,
        completion_token_ids=sampled.completion,
        completion_logprobs=sampled.logprobs,
        version_spans=[rollout_pb2.VersionSpan(policy_version=0, end=len(sampled.completion))],
        sampling=rollout_pb2.SamplingParams(temperature=TEMPERATURE),
        router_choices=pack_routes(sampled.routes, routers(model)[0].num_experts),
    )
    record = reward_pb2.RewardRecord(rollout_id=rollout_id, rollout=rollout, reward=1.0)
    return record.SerializeToString()


@pytest.fixture(scope="module")
def batch(policy: Policy) -> TrainBatch:
    """The sampler's rollouts, through the reward topic's bytes, as the trainer batches them."""
    model, samples = policy.model, []
    for seed, (prompt_len, new_tokens) in enumerate(PROMPTS):
        prompt = torch.randint(3, 300, (prompt_len,), generator=torch.Generator().manual_seed(seed))
        sampled = sample(model, prompt.tolist(), new_tokens, seed)
        wire = reward_record(model, sampled, f"r{seed}")
        record = reward_pb2.RewardRecord.FromString(wire)
        train_sample = to_sample(record, 256, vocab_size=model.config.vocab_size)
        assert isinstance(train_sample, TrainSample)
        samples.append(train_sample)
    return collate(samples)


@dataclass(frozen=True)
class Scored:
    max_gap: float
    """Largest |trainer's log-prob − sampler's| over the batch's completion tokens."""
    flips: int
    """(position, layer) decisions whose set of experts differs from the sampler's."""
    decisions: int


@torch.no_grad()
def score(model: PreTrainedModel, batch: TrainBatch, replay: bool) -> Scored:
    with replaying(batch, [model], enabled=replay), record_routes(model) as log:
        logp, _ = token_logprobs(model, batch)
    mask = batch.target_mask.bool()
    gap = (logp - batch.behaviour_logprobs)[mask].abs().max().item()
    assert batch.router_choices is not None
    trainer_routes = log.stacked().view(batch.router_choices.shape).sort(-1).values
    sampler_routes = batch.router_choices.long().sort(-1).values
    differs = (trainer_routes != sampler_routes).any(-1)[sampler_ran(batch)]
    return Scored(max_gap=gap, flips=int(differs.sum()), decisions=differs.numel())


def sampler_ran(batch: TrainBatch) -> torch.Tensor:
    """[B, L, layers] True at the positions the sampler ran: up to the last completion
    token, which is the last scored target's position + 1 and was never fed back."""
    assert batch.router_choices is not None
    rows, width, layers, _ = batch.router_choices.shape
    mask = batch.target_mask
    end = mask.shape[1] - mask.flip(-1).argmax(-1)  # one past the last scored position
    ran = torch.arange(width)[None, :] < end[:, None]
    return ran[:, :, None].expand(rows, width, layers)


def test_replayed_routes_give_the_samplers_logprobs_and_rerouting_does_not(policy, batch):
    on = score(policy.model, batch, replay=True)
    off = score(policy.model, batch, replay=False)
    print(
        f"\n{policy.model.config.model_type}, {policy.tied} experts tied: replay on "
        f"max|Δlogp| {on.max_gap:.2e}; off {off.max_gap:.2e}, {off.flips} of "
        f"{off.decisions} routing decisions flipped"
    )
    assert on.max_gap < 1e-5 and on.flips == 0
    if policy.tied:
        assert off.flips > 0 and off.max_gap > 1e-2
    else:
        assert off.flips == 0 and off.max_gap < 1e-5


@pytest.mark.parametrize("router_replay", [True, False])
def test_the_learner_replays_unless_the_setting_is_off(policy, batch, router_replay):
    """The step's importance ratio, taken before the optimizer moves the weights, is 1 on
    every token when replayed; re-routed it is not wherever an expert flipped."""
    settings = TrainerSettings(router_replay=router_replay)
    learner = LocalLearner(copy.deepcopy(policy.model), copy.deepcopy(policy.model), settings)
    metrics = learner.step(batch)
    if router_replay or not policy.tied:
        assert abs(metrics.ratio_mean - 1.0) < 1e-5
    else:
        assert abs(metrics.ratio_mean - 1.0) > 1e-3


def rollout_with_routes(prompt: int, completion: int, positions: int | None) -> bytes:
    """A reward record of a top-2-of-8, 2-layer MoE rollout whose routes hold ``positions``
    rows (None: no routes, as a dense policy's)."""
    rollout = rollout_pb2.RolloutRecord(
        arm=common_pb2.ARM_TREATMENT,
        prompt_token_ids=[5] * prompt,
        completion_token_ids=[6] * completion,
        completion_logprobs=[-1.0] * completion,
        version_spans=[rollout_pb2.VersionSpan(policy_version=0, end=completion)],
        sampling=rollout_pb2.SamplingParams(temperature=1.0),
    )
    if positions is not None:
        routes = torch.randint(0, 8, (positions, 2, 2), generator=torch.Generator().manual_seed(0))
        rollout.router_choices.CopyFrom(pack_routes(routes, 8))
    return reward_pb2.RewardRecord(rollout_id="r", rollout=rollout).SerializeToString()


@pytest.mark.parametrize(
    ("positions", "trained"),
    [
        (3 + 4 - 1, True),  # every position the sampler ran: prompt, and completion but its last
        (3 + 4, False),  # one row too many: routes of some other token list
        (4 - 1, False),  # the completion's only: the prompt would be re-routed
        (None, True),  # no routes: a dense policy's rollout
    ],
)
def test_a_rollouts_routes_must_cover_every_position_its_sampler_ran(positions, trained):
    record = reward_pb2.RewardRecord.FromString(rollout_with_routes(3, 4, positions))
    sample_ = to_sample(record, 256)
    assert isinstance(sample_, TrainSample) is trained
    if isinstance(sample_, TrainSample):
        assert (sample_.router_choices is None) is (positions is None)


def test_a_batch_is_replayed_whole_or_rerouted_whole():
    def sample_of(prompt: int, completion: int, routed: bool) -> TrainSample:
        positions = prompt + completion - 1 if routed else None
        record = reward_pb2.RewardRecord.FromString(
            rollout_with_routes(prompt, completion, positions)
        )
        sample_ = to_sample(record, 256)
        assert isinstance(sample_, TrainSample)
        return sample_

    routed = collate([sample_of(3, 4, True), sample_of(2, 2, True)])
    assert routed.router_choices is not None
    assert routed.router_choices.shape == (2, 7, 2, 2)
    # past the positions the second rollout's sampler ran: experts 0 and 1, never scored
    assert routed.router_choices[1, 3:].tolist() == [[[0, 1]] * 2] * 4
    assert collate([sample_of(3, 4, True), sample_of(2, 2, False)]).router_choices is None


@pytest.mark.parametrize("router_replay", [True, False])
def test_the_sharded_step_replays_each_ranks_rows(policy, batch, router_replay):
    """sharded_rl_step on a one-rank gloo group: each rank replays the routes of its own
    rows (slice_rows carries them), so the ratio is 1 where the one-process step's is."""
    with one_rank_group() as world:
        model = shard(copy.deepcopy(policy.model), world)
        ref = shard(copy.deepcopy(policy.model), world)
        metrics = sharded_rl_step(
            model,
            build_optimizer(model, 1e-4),
            batch,
            world,
            ref_model=ref,
            router_replay=router_replay,
        )
    if router_replay or not policy.tied:
        assert abs(metrics.ratio_mean - 1.0) < 1e-5
    else:
        assert abs(metrics.ratio_mean - 1.0) > 1e-3
