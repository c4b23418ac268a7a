"""`rtrl bench engine`'s multi-turn workload: an agent's turns with its keys and values kept
between them (inference/session_kv.py) against re-sending and re-prefilling the whole
history every turn, as a ratio in one run.

One agent at a time, on a tiny Qwen3 (the fast path; random weights, a context of
``turns * (observed + max_tokens)`` positions and more): each turn observes
``observed`` new tokens (a tool's output), then generates ``max_tokens`` (EOS ignored).
Both engines run the same turns, alternating agent by agent so a drift in the machine's
speed hits both; a turn's cost is its wall time from submit to its last token.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

from rtrl.inference.engine import Engine, EngineConfig
from rtrl.ops.tiny_model import tiny_config
from rtrl.policy import state_dict_fp32


# Produced by measure; part of rtrl.bench.engine.EngineResult.
@dataclass(frozen=True)
class TurnsResult:
    agents: int
    turns: int
    observed: int
    max_tokens: int
    kept_turn_s: float
    """Mean seconds per turn with the session's keys and values kept."""
    resent_turn_s: float
    """Mean seconds per turn re-prefilling the whole history."""
    ratio: float
    """resent_turn_s / kept_turn_s: how many times cheaper a kept turn is."""
    last_turn_ratio: float
    """The same for the last turn alone (the longest history)."""
    reused_positions: int
    """Positions the kept engine did not prefill again."""


def measure(
    agents: int = 3, turns: int = 20, observed: int = 50, max_tokens: int = 200
) -> TurnsResult:
    context = turns * (observed + max_tokens) + 64
    config = tiny_config("qwen3", 512, context)
    torch.manual_seed(0)
    weights = state_dict_fp32(AutoModelForCausalLM.from_config(config))
    engines = {
        name: Engine(EngineConfig(hf_config=config, decode=_ids_text, session_kv_tokens=tokens))
        for name, tokens in (("kept", context * 2), ("resent", 0))
    }
    for engine in engines.values():
        engine.stage("control", 0, weights)
        engine.stage("treatment", 0, weights)
        engine.start()
    seconds: dict[str, list[list[float]]] = {name: [] for name in engines}
    try:
        for agent in range(agents):
            for name, engine in engines.items():
                seconds[name].append(
                    _agent(engine, f"agent-{agent}", agent, turns, observed, max_tokens)
                )
    finally:
        for engine in engines.values():
            engine.stop()
    kept, resent = (sum(map(sum, seconds[n])) / (agents * turns) for n in ("kept", "resent"))
    last = {n: sum(s[-1] for s in seconds[n]) / agents for n in seconds}
    return TurnsResult(
        agents=agents,
        turns=turns,
        observed=observed,
        max_tokens=max_tokens,
        kept_turn_s=round(kept, 6),
        resent_turn_s=round(resent, 6),
        ratio=round(resent / kept, 3),
        last_turn_ratio=round(last["resent"] / last["kept"], 3),
        reused_positions=engines["kept"].sessions_resumed()[1],
    )


def _agent(
    engine: Engine, session: str, seed: int, turns: int, observed: int, max_tokens: int
) -> list[float]:
    """Each turn's seconds; the same ids whichever engine runs it (seeded)."""
    rng = random.Random(seed)
    history: list[int] = []
    took = []
    for turn in range(turns):
        history += [rng.randrange(3, 500) for _ in range(observed)]
        started = time.perf_counter()
        done = engine.generate(
            "control",
            history,
            max_tokens=max_tokens,
            seed=seed * 1000 + turn,
            ignore_eos=True,
            session=session,
        )
        took.append(time.perf_counter() - started)
        history += list(done.result.token_ids)
    return took


def _ids_text(ids: Sequence[int]) -> str:
    """The model has no tokenizer: its text is its ids."""
    return " ".join(map(str, ids))
