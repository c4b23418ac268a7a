"""`rtrl bench engine`: the embedded engine against Hugging Face `generate()`, and the
cost of swapping weights under load.

Everything runs in this process, on one torch thread, with one model (the demo
policy's shape), the same prompts (the simulator's task prompts) and the same lengths
(``max_tokens`` per completion: EOS is ignored by the engine and suppressed in
`generate()` with min_new_tokens):

* ``hf_generate_tokens_per_s``: `model.generate()` over batches of ``concurrency``
  left-padded prompts, sampling at temperature 1;
* ``tokens_per_s``: the engine with ``concurrency`` requests in flight at all times
  (each finished request submits the next), so the continuous batch stays full;
* ``ratio`` = tokens_per_s / hf_generate_tokens_per_s (target >= 2);
* ``swap_slowdown``: engine throughput while a new version arrives every
  ``swap_every_s`` (staged from another thread, as the weight subscriber does, with
  the default "keep" policy), divided by its throughput without swaps (target >= 0.9).
  ``swap_slowdown_recompute`` is the same with the "recompute" policy.
* ``turns``: an agent's turns with its keys and values kept between them against
  re-sending and re-prefilling its whole history every turn (bench/engine_turns.py):
  ``turns.ratio`` = seconds per re-prefilled turn / seconds per kept turn.

Phases alternate (no swaps, swaps, no swaps, ...) so a drift in the machine's speed
hits both sides; each rate is tokens over the span from the phase's start to its
last completion.
"""

from __future__ import annotations

import random
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from rtrl.bench import report
from rtrl.bench.engine_turns import TurnsResult
from rtrl.bench.engine_turns import measure as measure_turns
from rtrl.bench.report import code_version
from rtrl.inference.batch import SwapPolicy
from rtrl.inference.engine import Engine, EngineConfig, prompt_token_ids
from rtrl.policy import EOS, PAD, build_model, state_dict_fp32
from rtrl.simulator.tasks import random_task

SWAP_POLICIES: tuple[SwapPolicy, ...] = ("keep", "recompute")
"""Each measured in turn; "keep" against HF generate() too."""


@dataclass
class Phase:
    name: str
    tokens: int
    seconds: float
    swaps: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


# Produced by run, per measured phase; part of EngineResult.
@dataclass(frozen=True)
class PhaseResult:
    name: str
    tokens: int
    seconds: float
    tokens_per_s: float
    swaps: int


# Produced by run; written to bench/results/engine.json; read by its test and docs/benchmarks.md.
@dataclass(frozen=True)
class EngineResult:
    code: str
    """The commit of inference/ the engine ran at."""
    concurrency: int
    max_tokens: int
    torch_threads: int
    phase_s: float
    swap_every_s: float
    tokens_per_s: float
    """The engine's steady rate, no versions arriving."""
    hf_generate_tokens_per_s: float
    """The baseline: HF generate() on the same model and prompts, same process."""
    ratio: float
    """tokens_per_s over the baseline's."""
    swap_slowdown: float
    """The engine's rate while a version arrives every swap_every_s, over its steady rate."""
    swap_slowdown_recompute: float
    """The same with the recompute swap policy."""
    swaps: int
    phases: tuple[PhaseResult, ...]
    turns: TurnsResult | None = None
    """The multi-turn workload (None: not run)."""


def task_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [prompt_token_ids(random_task(rng).prompt) for _ in range(n)]


def hf_generate(
    model, prompts: list[list[int]], batch: int, max_tokens: int, seconds: float, progress: Progress
) -> Phase:
    task = progress.add_task("HF generate()", total=seconds)
    tokens, started, i = 0, time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        group = [prompts[(i + j) % len(prompts)] for j in range(batch)]
        i += batch
        width = max(len(p) for p in group)
        ids = torch.tensor([[PAD] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                pad_token_id=PAD,
                eos_token_id=EOS,
            )
        tokens += (out.shape[1] - width) * batch
        progress.update(task, completed=min(time.perf_counter() - started, seconds))
    return Phase("hf_generate", tokens, time.perf_counter() - started)


# Produced by run from its arguments; read by every phase.
@dataclass(frozen=True)
class Load:
    """What each phase asks of its generator: ``concurrency`` completions of ``max_tokens``
    tokens at a time, over ``prompts`` in turn."""

    prompts: list[list[int]]
    concurrency: int
    max_tokens: int


@dataclass
class _InFlight:
    """What engine_phase's submitter and completion callbacks share, under its lock."""

    tokens: int = 0
    in_flight: int = 0
    next: int = 0
    """Index of the next prompt to submit."""
    last: float = 0.0
    """perf_counter() of the latest completion."""
    error: BaseException | None = None


class _Swapper:
    """Stages a new version every ``every_s`` from its own thread while open, as the weight
    subscriber does; counts the swaps."""

    def __init__(self, engine: Engine, every_s: float, sets: list[dict[str, torch.Tensor]]) -> None:
        self.engine, self.every_s, self.sets = engine, every_s, sets
        self.swaps = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._swap, daemon=True)

    def _swap(self) -> None:
        while not self._stop.wait(self.every_s):
            version = self.engine.held_version("control") + 1
            self.engine.stage("control", version, self.sets[version % len(self.sets)])
            self.swaps += 1

    def __enter__(self) -> _Swapper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def engine_phase(
    engine: Engine,
    name: str,
    load: Load,
    seconds: float,
    progress: Progress,
    swap: tuple[float, list[dict[str, torch.Tensor]]] | None = None,
    label: str = "",
) -> Phase:
    """Keep ``load.concurrency`` requests in flight for ``seconds``; with ``swap`` =
    (every_s, weight sets), stage a new version every every_s from another thread."""
    task = progress.add_task(label or name, total=seconds)
    lock = threading.Lock()
    state = _InFlight()
    idle = threading.Event()
    started = time.perf_counter()
    deadline = started + seconds

    def submit() -> None:
        with lock:
            prompt = load.prompts[state.next % len(load.prompts)]
            state.next += 1
            state.in_flight += 1
        engine.submit(
            "control", prompt, max_tokens=load.max_tokens, temperature=1.0, ignore_eos=True
        ).add_done_callback(done)

    def done(future) -> None:
        if future.exception() is not None:
            state.error = future.exception()
            idle.set()
            return
        completion = future.result()
        now = time.perf_counter()
        with lock:
            state.tokens += len(completion.result.token_ids)
            state.in_flight -= 1
            state.last = now
            finished = state.in_flight == 0
        if now < deadline:
            submit()
        elif finished:
            idle.set()

    swapper = _Swapper(engine, *swap) if swap else None
    with swapper or nullcontext():
        for _ in range(load.concurrency):
            submit()
        while not idle.wait(0.25):
            progress.update(task, completed=min(time.perf_counter() - started, seconds))
    if state.error is not None:
        raise RuntimeError(f"{name}: a request failed") from state.error
    progress.update(task, completed=seconds)
    return Phase(name, state.tokens, state.last - started, swapper.swaps if swapper else 0)


def policy_phases(
    policy: SwapPolicy,
    model,
    sets: list[dict[str, torch.Tensor]],
    load: Load,
    phase_s: float,
    rounds: int,
    swap_every_s: float,
    progress: Progress,
) -> dict[str, list[Phase]]:
    """The engine under one swap policy, steady then swapping, ``rounds`` times for "keep"
    (each round after an HF generate() phase) and once for "recompute"; by phase name."""
    phases: dict[str, list[Phase]] = {}
    engine = Engine(EngineConfig(max_batch=load.concurrency, swap_policy=policy))
    engine.stage("control", 0, sets[0])
    engine.start()
    try:
        engine_phase(engine, f"warm-up ({policy})", load, 1.0, progress)
        for r in range(rounds if policy == "keep" else 1):
            if policy == "keep":
                phases.setdefault("hf_generate", []).append(
                    hf_generate(
                        model, load.prompts, load.concurrency, load.max_tokens, phase_s, progress
                    )
                )
            for swapping in (False, True):
                name = f"engine_{policy}_{'swaps' if swapping else 'steady'}"
                swap = (swap_every_s, sets) if swapping else None
                phases.setdefault(name, []).append(
                    engine_phase(engine, name, load, phase_s, progress, swap, f"{name} {r + 1}")
                )
    finally:
        engine.stop()
    return phases


def run(
    out: Path,
    console: Console,
    concurrency: int = 8,
    max_tokens: int = 48,
    phase_s: float = 10.0,
    rounds: int = 2,
    swap_every_s: float = 2.0,
    turns: tuple[int, int, int, int] | None = (3, 20, 50, 200),
) -> EngineResult:
    """``turns``: the multi-turn workload's (agents, turns, observed, max_tokens), None to
    skip it."""
    torch.set_num_threads(1)
    model = build_model(seed=1)
    sets = [state_dict_fp32(build_model(seed=s)) for s in (1, 2)]
    load = Load(task_prompts(256), concurrency, max_tokens)
    phases: dict[str, list[Phase]] = {}
    with Progress(console=console, transient=True) as progress:
        for policy in SWAP_POLICIES:
            phases |= policy_phases(
                policy, model, sets, load, phase_s, rounds, swap_every_s, progress
            )
        multi_turn = None
        if turns is not None:
            task = progress.add_task(f"{turns[0]} agents x {turns[1]} turns, kept vs re-sent")
            multi_turn = measure_turns(*turns)
            progress.update(task, completed=100)
    result = replace(_result(phases, load, phase_s, swap_every_s), turns=multi_turn)
    report.write(out, result)
    _print(result, out, console)
    return result


def _result(
    phases: dict[str, list[Phase]], load: Load, phase_s: float, swap_every_s: float
) -> EngineResult:
    def rate(name: str) -> float:
        return sum(p.tokens for p in phases[name]) / sum(p.seconds for p in phases[name])

    steady, hf = rate("engine_keep_steady"), rate("hf_generate")
    swapped = ("engine_keep_swaps", "engine_recompute_swaps")
    return EngineResult(
        code=code_version("inference"),
        concurrency=load.concurrency,
        max_tokens=load.max_tokens,
        torch_threads=torch.get_num_threads(),
        phase_s=phase_s,
        swap_every_s=swap_every_s,
        tokens_per_s=round(steady, 1),
        hf_generate_tokens_per_s=round(hf, 1),
        ratio=round(steady / hf, 3),
        swap_slowdown=round(rate("engine_keep_swaps") / steady, 3),
        swap_slowdown_recompute=round(
            rate("engine_recompute_swaps") / rate("engine_recompute_steady"), 3
        ),
        swaps=sum(p.swaps for name in swapped for p in phases[name]),
        phases=tuple(
            PhaseResult(p.name, p.tokens, round(p.seconds, 3), round(p.tokens_per_s, 1), p.swaps)
            for ps in phases.values()
            for p in ps
        ),
    )


def _print(r: EngineResult, out: Path, console: Console) -> None:
    threads = f"{r.torch_threads} torch thread"
    table = Table(
        title=f"bench engine -> {out} ({r.concurrency} in flight, {r.max_tokens} tokens each, {threads})"
    )
    for column in ("generator", "tokens/s", "vs HF generate()"):
        table.add_column(column, justify="right")
    hf = r.hf_generate_tokens_per_s
    for name, value in (("HF generate()", hf), ("engine", r.tokens_per_s)):
        table.add_row(name, f"{value:,.0f}", f"{value / hf:.2f}")
    console.print(table)
    if r.turns is not None:
        t = r.turns
        console.print(
            f"multi-turn ({t.agents} agents x {t.turns} turns of {t.observed} observed + "
            f"{t.max_tokens} generated): {t.kept_turn_s * 1000:.0f} ms a turn kept, "
            f"{t.resent_turn_s * 1000:.0f} ms re-sent: ratio {t.ratio:.2f} "
            f"(last turn {t.last_turn_ratio:.2f})"
        )
    console.print(
        f"ratio {r.ratio:.2f} (target >= 2), swap_slowdown {r.swap_slowdown:.3f} (target >= 0.9; a version every "
        f"{r.swap_every_s:g} s, {r.swaps} swaps), recompute policy {r.swap_slowdown_recompute:.3f}"
    )
