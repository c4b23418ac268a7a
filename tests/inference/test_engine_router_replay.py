"""The engine records a MoE policy's routes, and its rollout records carry them: the
trainer's full forward over prompt and completion, routed as the engine routed, gives
the engine's log-probs; re-routed, near-tied experts flip and the log-probs move.

The engine serves a MoE model through transformers' forward on its own KV cache (a
prefill, then one token at a time), recording the experts chosen at every position it
ran. The trainer scores the rollout with one forward over the whole sequence. Their
router logits differ by rounding, which flips only near-tied experts; so the checkpoint
gets some (router rows equal to 3e-9), as in tests/trainer/test_router_replay.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from rtrl.checkpoint import Checkpoint
from rtrl.inference.engine import ARMS, Completion, Engine, EngineConfig
from rtrl.inference.records import RolloutContext, VersionSpan, rollout_record, version_spans
from rtrl.moe import record_routes, replay_routes, unpack_routes
from rtrl.ops.tiny_model import write_tiny_checkpoint
from rtrl.policy import load_weights, state_dict_fp32
from rtrl.v1 import rollout_pb2
from support.moe import tie_experts

torch.set_num_threads(1)

TEMPERATURE = 0.8
TIED = 4
"""Experts per layer (of 8) the router barely tells apart."""
MESSAGES = (
    "Please rename the variable.",
    "Why did you change the indentation? Use two spaces here.",
    "hi",
)


@dataclass(frozen=True)
class Policy:
    checkpoint: Checkpoint
    model: PreTrainedModel
    """The trainer's model: the checkpoint with near-tied experts (float32)."""
    weights: dict[str, torch.Tensor]
    """``model``'s weights as the trainer stages them."""


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Policy:
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_moe") / "model", "qwen3_moe")
    checkpoint = Checkpoint.open(path)
    model = checkpoint.load_model()
    tie_experts(model, TIED)
    return Policy(checkpoint, model, state_dict_fp32(model))


def engine(policy: Policy, weights: dict[str, torch.Tensor], **config) -> Engine:
    """An engine (not started) serving ``weights`` as version 0 of both arms."""
    ckpt = policy.checkpoint
    eng = Engine(EngineConfig(hf_config=ckpt.config, decode=ckpt.decode, **config))
    for arm in ARMS:
        eng.stage(arm, 0, weights)
    return eng


def context(rollout_id: str) -> RolloutContext:
    return RolloutContext(
        rollout_id=rollout_id,
        session_id="s-1",
        user_id="u-1",
        client_ts_ms=1,
        worker_id="w-1",
        model_name="rtrl-policy",
        prompt_text="",
    )


@dataclass(frozen=True)
class Scored:
    logprobs: torch.Tensor
    """The trainer's log-prob of each completion token (at the sampling temperature)."""
    flips: int
    """(position, layer) decisions whose set of experts differs from the record's."""
    decisions: int


@torch.no_grad()
def score(model: PreTrainedModel, record: rollout_pb2.RolloutRecord, replay: bool) -> Scored:
    """The trainer's forward over every position the sampler ran, replaying the record's
    routes or routing anew, and the routing decisions that differ from the record's."""
    prompt, completion = list(record.prompt_token_ids), list(record.completion_token_ids)
    routes = unpack_routes(record.router_choices).long()
    ids = torch.tensor([prompt + completion[:-1]])
    # Replay's hooks first, so the routes recorded are the ones the forward used.
    with replay_routes(model, routes) if replay else nullcontext(), record_routes(model) as log:
        logits = model(input_ids=ids).logits[0]
    logp = torch.log_softmax(logits[len(prompt) - 1 :].float() / TEMPERATURE, dim=-1)
    differs = (log.stacked().sort(-1).values != routes.sort(-1).values).any(-1)
    return Scored(
        logp.gather(-1, torch.tensor(completion)[:, None])[:, 0],
        int(differs.sum()),
        differs.numel(),
    )


def generate(
    eng: Engine, prompts: Sequence[list[int]], max_tokens: Sequence[int]
) -> list[Completion]:
    """The prompts queued before the engine starts, so they share one batch: rows of
    unequal lengths, finishing at different steps (a finished row's place is taken by
    the last row's)."""
    futures = [
        eng.submit(
            "treatment", prompt, max_tokens=n, temperature=TEMPERATURE, seed=seed, ignore_eos=True
        )
        for seed, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True))
    ]
    eng.start()
    try:
        return [f.result() for f in futures]
    finally:
        eng.stop()


@pytest.fixture(scope="module")
def records(policy: Policy) -> list[rollout_pb2.RolloutRecord]:
    prompts = [policy.checkpoint.render_chat([{"role": "user", "content": m}]) for m in MESSAGES]
    completions = generate(engine(policy, policy.weights, max_batch=4), prompts, (40, 12, 26))
    return [rollout_record(context(f"r{i}"), c) for i, c in enumerate(completions)]


def test_a_record_holds_the_routes_of_every_position_the_engine_ran(records):
    for record in records:
        routes = unpack_routes(record.router_choices)
        ran = len(record.prompt_token_ids) + len(record.completion_token_ids) - 1
        assert routes.shape == (ran, 2, 2)  # the tiny model: 2 MoE layers, top-2 of 8
        assert record.router_choices.num_experts == 8


def test_replayed_routes_give_the_engines_logprobs_and_rerouting_does_not(policy, records):
    gaps_on, gaps_off, flips, decisions = [], [], 0, 0
    for record in records:
        behaviour = torch.tensor(record.completion_logprobs)
        on = score(policy.model, record, replay=True)
        off = score(policy.model, record, replay=False)
        assert on.flips == 0
        gaps_on.append(float((on.logprobs - behaviour).abs().max()))
        gaps_off.append(float((off.logprobs - behaviour).abs().max()))
        flips, decisions = flips + off.flips, decisions + off.decisions
    print(
        f"\nengine rollouts, {TIED} experts tied: replay on max|Δlogp| {max(gaps_on):.2e}; "
        f"off {max(gaps_off):.2e}, {flips} of {decisions} routing decisions flipped"
    )
    assert max(gaps_on) < 1e-5
    assert flips > 0 and max(gaps_off) > 1e-2


@pytest.mark.parametrize("policy_name", ["keep", "recompute"])
def test_a_swap_mid_generation_keeps_one_route_per_position(policy, policy_name):
    """Under "recompute" the prefix is routed again by the new weights, and the record
    keeps those routes: the tokens sampled after the swap saw them, so replayed under
    the new weights they get their log-probs back. Under "keep" the prefix keeps the
    old weights' keys, values and routes (no single version's forward reproduces it)."""
    swap_after, n = 5, 16
    generator = torch.Generator().manual_seed(2)
    # Routers untouched, so the new version's experts stay near-tied.
    new_weights = {
        name: t
        if name.endswith("mlp.gate.weight")
        else t + 0.05 * torch.randn(t.shape, generator=generator)
        for name, t in policy.weights.items()
    }

    def on_step(arm: str, generated: int) -> None:
        if generated == swap_after:
            eng.stage(arm, 1, new_weights)

    eng = engine(policy, policy.weights, swap_policy=policy_name)
    eng.on_step = on_step
    prompt = policy.checkpoint.render_chat([{"role": "user", "content": MESSAGES[2]}])
    (completion,) = generate(eng, [prompt], [n])
    assert version_spans(completion.result.versions) == [
        VersionSpan(0, 0, swap_after),
        VersionSpan(1, swap_after, n),
    ]
    record = rollout_record(context("swapped"), completion)
    assert unpack_routes(record.router_choices).shape[0] == len(prompt) + n - 1
    if policy_name == "recompute":
        new_model = AutoModelForCausalLM.from_config(
            policy.checkpoint.config, dtype=torch.float32
        ).eval()
        load_weights(new_model, new_weights)
        on = score(new_model, record, replay=True)
        behaviour = torch.tensor(record.completion_logprobs)
        torch.testing.assert_close(
            on.logprobs[swap_after:], behaviour[swap_after:], atol=1e-5, rtol=0
        )
