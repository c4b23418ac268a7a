"""The agent's warm start: a policy that writes well-formed helpers after a plausible but
wasteful use of the tools (simulator/agent.py), for RL to make frugal.

Each trajectory of the supervised data is drawn from one habit, whatever the project:

* 15 % of the time it answers at once;
* otherwise it reads the configuration (70 %), the file (70 %) and greps (35 %), in a
  random order, mostly one call per turn (a pair shares a turn 20 % of the time), then lints
  (50 %), often twice (half of those);
* 6 % of the trajectories hold a misspelt call, which ends them (the serving API answers a
  turn of broken calls as text: simulator/agent.py).

Its answer is written in a random style, except that in the mixed project (p4) it takes
the indent from the configuration and the quotes from the file when it read them. So the
warm start copies what it reads, but reads everywhere: in p0-p3 the tools tell nothing
and cost time. RL has to teach it to answer p0-p3 directly in their house style (learnt
from feedback, as in the single-turn product), to read in p4 only, both in one turn, and
to stop misspelling.

As simulator/warmstart.py does, every drawn trajectory is written in each of the four
styles (its tool answers in p4 following the style), so style choices are exactly 50/50
per batch, and the auxiliary project head keeps the project tag salient.
"""

from __future__ import annotations

import inspect
import random
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import rtrl.simulator.agent
import rtrl.simulator.agent_play
from rtrl.checkpoint import AGENT_CHAT_TEMPLATE
from rtrl.policy import BOS, EOS, PAD, PolicyConfig, encode
from rtrl.simulator import warmstart
from rtrl.simulator.agent import MISSPELT, observe, render_calls, render_result
from rtrl.simulator.agent_play import held_out, play
from rtrl.simulator.tasks import (
    INDENTS,
    MIXED_PROJECT,
    PROJECT_STYLES,
    QUESTION_TOPICS,
    QUOTES,
    Style,
    Task,
    parse_style,
    random_task,
    with_random_serial,
)

AGENT_POLICY = PolicyConfig(max_positions=256)
WRITTEN_SHARE = 0.5
"""Share of the p4 users whose files show their style (simulator/users.py)."""
QUESTION_RATE, MIXED_QUESTION_RATE = 0.02, 0.2
"""Share of the trajectories that end in a clarifying question (simulator/tasks.py), in
p0-p3 and in p4, as the single-turn warm start asks: what reward r1 can grow."""
"""The demo agent's shape: the demo policy's, with room for a wasteful trajectory."""


@dataclass(frozen=True)
class AgentQuality:
    samples: int
    well_formed: float
    """Share of trajectories whose answer is a correct helper in some style or a question."""
    question_rate: float
    calls: float
    """Calls per trajectory."""
    broken: float
    """Share of trajectories with a broken call."""
    turns: float
    parallel_share: float
    """Share of turns with calls that made more than one."""
    copied: float
    """In p4, after reading both from a user who writes their style down, the share of
    answers in the style read."""


@dataclass(frozen=True)
class AgentRecipe:
    batch_size: int = 64
    """Rows per step: batch_size / 4 drawn trajectories in each of the four styles."""
    lr: float = 1e-3
    warmup_steps: int = 50
    decay_from: int = 600
    """From this step the learning rate falls linearly, to final_lr_share of lr at max_steps.
    Writing helpers is learnt in a sudden transition around step 550; at a constant rate the
    share of well-formed trajectories then swung between 0.5 and 0.8 from one evaluation to the
    next, so stopping on it was a lottery that often ran to the cap (8.5 min on 2 cores)."""
    final_lr_share: float = 0.1
    min_steps: int = 650
    max_steps: int = 900
    eval_every: int = 50
    eval_samples: int = 128
    target_well_formed: float = 0.7
    """Stop when this share of held-out trajectories (temperature 1) end in a helper or a
    question: the rest misspell a call or run out of turns, as a wasteful agent does."""
    mixed_share: float = 0.5
    """Share of the tasks drawn in p4, the only project where copying what was read pays:
    more of them teach the copy sooner (a fifth took over 1,200 steps to copy 60 %)."""
    context_aux_weight: float = 0.1
    seed: int = 0
    chat_template: str = AGENT_CHAT_TEMPLATE

    def batch(self, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        draws = self.batch_size // len(PROJECT_STYLES)
        rows = [row for _ in range(draws) for row in _drawn(rng, self.mixed_share)]
        width = max(len(ids) for _, ids, _ in rows)
        ids = torch.tensor([r + [PAD] * (width - len(r)) for _, r, _ in rows])
        mask = torch.tensor([m + [0.0] * (width - 1 - len(m)) for _, _, m in rows])
        return ids, mask, torch.tensor([task.project for task, _, _ in rows])

    def lr_at(self, step: int) -> float:
        lr = warmstart.warmed_up_lr(self.lr, self.warmup_steps, step)
        if step < self.decay_from:
            return lr
        done = (step - self.decay_from) / max(self.max_steps - self.decay_from, 1)
        return lr * (1.0 - (1.0 - self.final_lr_share) * min(done, 1.0))

    def ready(self, model: torch.nn.Module, step: int) -> bool:
        if step < self.min_steps or step % self.eval_every:
            return False
        quality = measure(model, self.eval_samples, seed=self.seed + 1)
        return quality.well_formed >= self.target_well_formed

    def quality(self, model: torch.nn.Module) -> AgentQuality:
        return measure(model)

    def sources(self) -> list[Path]:
        modules = (rtrl.simulator.agent, rtrl.simulator.agent_play)
        return [*warmstart.WarmStartRecipe().sources(), *map(_file, modules), Path(__file__)]


def _file(module: object) -> Path:
    return Path(inspect.getfile(module))  # type: ignore[arg-type]


def habit(rng: random.Random) -> tuple[list[list[str]], bool]:
    """One trajectory's calls, turn by turn, and whether its last turn is a misspelt call."""
    if rng.random() < 0.15:
        return [], False
    calls = [name for name, p in (("cfg", 0.7), ("read", 0.7), ("grep", 0.35)) if rng.random() < p]
    rng.shuffle(calls)
    if rng.random() < 0.5:
        calls += ["lint"] * (2 if rng.random() < 0.5 else 1)
    turns: list[list[str]] = []
    while calls:
        pair = len(calls) > 1 and calls[0] != calls[1] and rng.random() < 0.2
        turns.append(calls[: 1 + pair])
        calls = calls[1 + pair :]
    if rng.random() < 0.06:
        turns = turns[: rng.randrange(len(turns) + 1)] + [[rng.choice(MISSPELT)]]
        return turns, True
    return turns, False


def conversation(
    task: Task, turns: list[list[str]], broken: bool, written: Style | None, answer: str
) -> list[dict[str, Any]]:
    """The chat of one habit, as the agent's harness would send it after its last turn: its
    calls answered for a user whose files show ``written``, then ``answer`` (none after a
    misspelt call, which ends it)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": task.prompt}]
    for k, calls in enumerate(turns):
        ids = [f"call_{k}_{i}" for i in range(len(calls))]
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": i, "type": "function", "function": {"name": name, "arguments": {}}}
                    for i, name in zip(ids, calls, strict=True)
                ],
            }
        )
        if broken and k == len(turns) - 1:
            return messages
        messages += [
            {"role": "tool", "tool_call_id": i, "content": observe(name, written)}
            for i, name in zip(ids, calls, strict=True)
        ]
    messages.append({"role": "assistant", "content": answer})
    return messages


def encoded(messages: list[dict[str, Any]]) -> tuple[list[int], list[float]]:
    """The ids the agent's chat template renders ``messages`` to, and which of them the policy
    writes (its turns and their end tokens): the warm start's target mask."""
    ids, mask = [BOS], []
    for message in messages:
        if message["role"] == "assistant":
            names = [call["function"]["name"] for call in message.get("tool_calls") or []]
            piece = encode((message["content"] or "") + render_calls(names)) + [EOS]
        elif message["role"] == "tool":
            piece = encode(render_result(message["content"]))
        else:
            piece = encode(message["content"])
        ids += piece
        mask += [float(message["role"] == "assistant")] * len(piece)
    return ids, mask


def _drawn(rng: random.Random, mixed_share: float) -> list[tuple[Task, list[int], list[float]]]:
    """One habit on one task (in p4 with ``mixed_share``), written in each style: (task, ids,
    target mask) rows."""
    project = MIXED_PROJECT if rng.random() < mixed_share else rng.randrange(MIXED_PROJECT)
    task = with_random_serial(random_task(rng, project), rng)
    turns, broken = habit(rng)
    read = {name for calls in (turns[:-1] if broken else turns) for name in calls}
    writes = task.project == MIXED_PROJECT and rng.random() < WRITTEN_SHARE
    asks = rng.random() < (MIXED_QUESTION_RATE if task.project == MIXED_PROJECT else QUESTION_RATE)
    topic = rng.choice(QUESTION_TOPICS)
    rows = []
    for style in PROJECT_STYLES:
        written = style if writes else None
        answer = Style(
            style.indent if written and "cfg" in read else rng.choice(INDENTS),
            style.quote if written and "read" in read else rng.choice(QUOTES),
        )
        if task.project != MIXED_PROJECT:
            answer = style
        text = task.question(topic) if asks else task.render(answer)
        rows.append((task, *encoded(conversation(task, turns, broken, written, text))))
    return rows


@torch.no_grad()
def measure(model: torch.nn.Module, samples: int = 200, seed: int = 1) -> AgentQuality:
    """Play held-out tasks of every project (agent_play.held_out) and judge the trajectories."""
    cases = held_out(samples, seed)
    was_training = model.training
    model.eval()
    runs = play(
        model,
        [c.task for c in cases],
        [c.written for c in cases],
        max_positions=AGENT_POLICY.max_positions,
        generator=torch.Generator().manual_seed(seed),
    )
    model.train(was_training)
    parsed = [parse_style(c.task, r.final_text) for c, r in zip(cases, runs, strict=True)]
    questions = [
        r.final_text in {c.task.question(topic) for topic in QUESTION_TOPICS}
        for c, r in zip(cases, runs, strict=True)
    ]
    copied = [
        p == c.written
        for c, r, p in zip(cases, runs, parsed, strict=True)
        if c.written is not None and {"cfg", "read"} <= set(r.calls)
    ]
    call_turns = sum(r.turns - (not r.truncated) for r in runs)
    return AgentQuality(
        samples=samples,
        well_formed=sum(p is not None or q for p, q in zip(parsed, questions, strict=True))
        / samples,
        question_rate=sum(questions) / samples,
        calls=statistics.mean(len(r.calls) for r in runs),
        broken=sum(r.broken > 0 for r in runs) / samples,
        turns=statistics.mean(r.turns for r in runs),
        parallel_share=sum(r.parallel_turns for r in runs) / max(call_turns, 1),
        copied=statistics.mean(copied) if copied else float("nan"),
    )


def agent_policy(state_dir: Path, policy_config: PolicyConfig, seed: int) -> Path:
    """The agentic demo's initial policy (trainer.plugins.InitialPolicy); the trainer's
    policy_config is the demo policy's, so the agent's own shape is used."""
    del policy_config
    return warmstart.ensure_warm_start(
        state_dir, policy_config=AGENT_POLICY, recipe=AgentRecipe(seed=seed)
    )
