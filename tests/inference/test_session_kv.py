"""Agents' keys and values kept between turns (inference/session_kv.py): a turn that
resumes its session prefills only its new tokens and samples exactly what a full prefill
of its history samples; a version that arrives between turns is reused under "keep" and
prefilled again under "recompute"; the table stays within its bound."""

from __future__ import annotations

import pytest
import torch

from rtrl.inference.batch import SwapPolicy
from rtrl.inference.engine import Engine, EngineConfig, prompt_token_ids
from rtrl.inference.session_kv import Parked, SessionKV
from rtrl.policy import build_model, state_dict_fp32

torch.set_num_threads(1)

V0, V1 = (state_dict_fp32(build_model(seed=s)) for s in (1, 5))


def _turns(engine: Engine, session: str, turns: int = 4, stage_between=None) -> list:
    """An agent's turns: each prompt is the last prompt, what was sampled, and a new
    observation; ``stage_between(turn)`` may stage a version before a turn."""
    prompt = prompt_token_ids("@p0 say hi\n")
    completions = []
    for turn in range(turns):
        if stage_between is not None:
            stage_between(turn)
        done = engine.generate(
            "control", prompt, max_tokens=12, seed=turn, ignore_eos=True, session=session
        )
        completions.append(done)
        prompt = [*prompt, *done.result.token_ids, *prompt_token_ids(f"@p{turn} ok\n")]
    return completions


def _engine(policy: SwapPolicy = "keep", kept: int = 10_000) -> Engine:
    engine = Engine(EngineConfig(swap_policy=policy, session_kv_tokens=kept))
    engine.stage("control", 0, V0)
    engine.stage("treatment", 0, V0)
    return engine.start()


def test_a_resumed_turn_samples_what_a_full_prefill_samples():
    kept, full = _engine(), _engine(kept=0)
    try:
        resumed = _turns(kept, "agent-1")
        whole = _turns(full, "agent-1")
    finally:
        kept.stop()
        full.stop()
    hits, reused = kept.sessions_resumed()
    assert hits == 3  # every turn after the first
    assert reused == sum(len(c.prompt_ids) + 11 for c in resumed[:-1])
    for a, b in zip(resumed, whole, strict=True):
        assert a.prompt_ids == b.prompt_ids
        assert a.result.token_ids == b.result.token_ids
        assert a.result.logprobs == pytest.approx(b.result.logprobs, abs=1e-5)


@pytest.mark.parametrize("policy, hits", [("keep", 3), ("recompute", 2)])
def test_a_version_between_turns_is_reused_or_prefilled_again_by_the_swap_policy(policy, hits):
    engine = _engine(policy)

    def swap_before_third(turn: int) -> None:
        if turn == 2:
            engine.stage("control", 1, V1)
            while engine.versions()["control"] != 1:
                engine.generate("treatment", [1, 2], max_tokens=1)  # lets the engine apply it

    try:
        turns = _turns(engine, "agent-2", stage_between=swap_before_third)
    finally:
        engine.stop()
    assert engine.sessions_resumed()[0] == hits
    assert [set(c.result.versions) for c in turns] == [{0}, {0}, {1}, {1}]
    if policy == "recompute":  # the third turn's context is the new version's: exact
        model = build_model(seed=5)
        third = turns[2]
        ids = [*third.prompt_ids, *third.result.token_ids]
        with torch.inference_mode():
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0], -1)
        start = len(third.prompt_ids) - 1
        expected = [float(logp[start + t, tok]) for t, tok in enumerate(third.result.token_ids)]
        assert third.result.logprobs == pytest.approx(expected, abs=1e-4)


def test_the_table_keeps_its_bound_and_a_forgotten_session_prefills_in_full():
    table = SessionKV(10, reuse_across_versions=True)
    k, v = torch.zeros(1, 1, 1, 6), torch.zeros(1, 1, 6, 1)
    table.park("a", Parked(tuple(range(6)), k, v, 0))
    table.park("b", Parked(tuple(range(6)), k, v, 0))  # over 10 positions: "a" goes
    assert table.tokens == 6
    assert table.take("a", tuple(range(8)), 0) is None
    assert table.take("b", (0, 1, 2, 3, 4, 9, 9), 0) is None  # not an extension
    table.park("b", Parked(tuple(range(6)), k, v, 0))
    table.forget("b")
    assert table.take("b", tuple(range(8)), 0) is None and table.tokens == 0
