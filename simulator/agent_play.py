"""The agentic product's trajectories played in process, turn by turn, with the trainer's own
sampler: what the agent's warm start judges itself by and what its eval suite scores.

The serving API plays the same loop for the product (simulator/agent_product.py): sample a
turn up to its end token; a turn of calls gets each valid call's answer (its ids as the
chat template renders them: simulator/agent.py) and another turn; a turn without a valid
call is the answer. Here the ids of a trajectory are built directly, since the demo policy's
template renders exactly the text its characters encode.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from rtrl.inference.tool_calls import parse
from rtrl.policy import BOS, EOS, decode, encode
from rtrl.simulator.agent import (
    AGENT_MAX_TOKENS,
    MAX_TURNS,
    TOOL_NAMES,
    observe,
    render_result,
    turn_latency_s,
)
from rtrl.simulator.tasks import (
    INDENTS,
    MIXED_PROJECT,
    PROJECT_STYLES,
    QUOTES,
    Style,
    Task,
    random_task,
    with_random_serial,
)
from rtrl.trainer.sampling import sample


@dataclass
class Played:
    """One trajectory: its ids, which of them the policy sampled, and what it did."""

    ids: list[int]
    prompt_len: int
    sampled: list[bool] = field(default_factory=list)
    """Per id after the first: sampled by the policy (True) or prompt and tool answers."""
    final_text: str = ""
    turns: int = 0
    calls: list[str] = field(default_factory=list)
    """Every call written, valid or not, in order."""
    broken: int = 0
    parallel_turns: int = 0
    tool_time_s: float = 0.0
    truncated: bool = False
    """It ran out of turns, positions or a turn's token budget."""

    @property
    def generated(self) -> int:
        return sum(self.sampled)

    @property
    def observed(self) -> int:
        """Ids of the tools' answers."""
        return len(self.ids) - self.prompt_len - self.generated


@dataclass(frozen=True)
class Case:
    """A task to play, for a user of ``style`` whose files show ``written``."""

    task: Task
    style: Style
    written: Style | None


def held_out(count: int, seed: int) -> list[Case]:
    """``count`` tasks of every project; in p4 a random style, written down every other one."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        task = with_random_serial(random_task(rng), rng)
        if task.project != MIXED_PROJECT:
            cases.append(Case(task, PROJECT_STYLES[task.project], None))
            continue
        style = Style(rng.choice(INDENTS), rng.choice(QUOTES))
        cases.append(Case(task, style, style if len(cases) % 2 else None))
    return cases


@torch.no_grad()
def play(
    model: torch.nn.Module,
    tasks: list[Task],
    written: list[Style | None],
    *,
    max_positions: int,
    generator: torch.Generator | None = None,
    temperature: float = 1.0,
) -> list[Played]:
    """Each task played to its answer for a user whose files show the matching ``written``
    style (User.written_style)."""
    runs = []
    for task in tasks:
        prompt = [BOS, *encode(task.prompt)]
        runs.append(Played(prompt, len(prompt), [False] * (len(prompt) - 1)))
    active = list(range(len(tasks)))
    for turn in range(MAX_TURNS):
        if not active:
            break
        outs = sample(
            model,
            [runs[i].ids for i in active],
            temperature=temperature,
            max_new_tokens=AGENT_MAX_TOKENS,
            generator=generator,
            one_batch=True,
        )
        still = []
        for i, out in zip(active, outs, strict=True):
            if _turn(runs[i], list(out.completion_ids), written[i], turn, max_positions):
                still.append(i)
        active = still
    return runs


def _turn(
    run: Played, ids: list[int], written: Style | None, turn: int, max_positions: int
) -> bool:
    """Add one sampled turn (and its calls' answers); True when the trajectory goes on."""
    run.ids += ids
    run.sampled += [True] * len(ids)
    run.turns += 1
    text = decode(ids)
    ended = ids[-1] == EOS
    # The serving API's own parser of the demo agent's syntax (inference/tool_calls.py).
    calls = parse(text, TOOL_NAMES, "bang").calls if ended else ()
    valid = [call.name for call in calls if call.valid]
    run.calls += [call.name for call in calls]
    run.broken += len(calls) - len(valid)
    run.parallel_turns += len(calls) > 1
    if not valid:
        run.final_text, run.truncated = text, not ended
        return False
    for name in valid:
        answer = encode(render_result(observe(name, written)))
        run.ids += answer
        run.sampled += [False] * len(answer)
    run.tool_time_s += turn_latency_s(valid)
    if turn == MAX_TURNS - 1 or len(run.ids) + AGENT_MAX_TOKENS > max_positions:
        run.final_text, run.truncated = "", True
        return False
    return True
