"""Simulated users: each works in one project and has a pet peeve about its house style.

A user keeps an edit whose style matches the house style on the dimensions they care
about; otherwise they rewrite the offending line (a later snapshot of the region
shows the agent's other lines still there) and often send an annoyed follow-up.

Fewer users care about quotes than about indentation: in earlier runs the quote
choice was learned more slowly, and a product's users are rarely uniform anyway.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from simulator.tasks import PROJECT_STYLES, Style, Task, parse_style

PEEVES = ("indent", "quote")
# (peeves, share of users)
PEEVE_MIX = ((frozenset({"indent"}), 0.5), (frozenset({"quote"}), 0.2), (frozenset({"indent", "quote"}), 0.3))

ANNOYED = {
    "indent": ("no, use {indent}-space indent like the rest of the file", "wrong indentation again, this project uses {indent} spaces"),
    "quote": ("no, we use {quote_name} quotes here", "why did you switch the quotes? revert to {quote_name} quotes"),
    "broken": ("that's not valid code, it broke the build", "no, that is wrong, undo it"),
}
CONTENT = ("thanks, now add a test for it", "great, can you also add a docstring?", "ok, next do the same for errors")


@dataclass(frozen=True)
class User:
    user_id: str
    project: int
    peeves: frozenset[str]
    privacy_mode: bool = False

    @property
    def house_style(self) -> Style:
        return PROJECT_STYLES[self.project]


@dataclass(frozen=True)
class Reaction:
    """What the user's editor reports about one edit."""

    region_text: str
    persisted_fraction: float
    followup: str | None
    dissatisfied: bool


def population(size: int, seed: int = 7, privacy_share: float = 0.0) -> list[User]:
    rng = random.Random(seed)
    users = []
    for i in range(size):
        roll, acc = rng.random(), 0.0
        peeves = PEEVE_MIX[-1][0]
        for candidate, share in PEEVE_MIX:
            acc += share
            if roll < acc:
                peeves = candidate
                break
        users.append(User(f"user-{seed}-{i:04d}", rng.randrange(len(PROJECT_STYLES)), peeves, rng.random() < privacy_share))
    return users


def react(user: User, task: Task, completion: str, rng: random.Random) -> Reaction:
    """The user's hidden judgement of an edit. The policy only ever sees its consequences."""
    house = user.house_style
    agent_lines = [line for line in completion.splitlines() if line.strip()]
    style = parse_style(task, completion)
    if style is None:
        # Not a correct helper: the user rewrites all of it.
        region = task.render(house)
        kept = sum(line in region.splitlines() for line in agent_lines)
        followup = rng.choice(ANNOYED["broken"]) if rng.random() < 0.8 else None
        return Reaction(region, kept / max(len(agent_lines), 1), followup, followup is not None)

    violated = [p for p in PEEVES if p in user.peeves and getattr(style, p) != getattr(house, p)]
    if not violated:
        followup = rng.choice(CONTENT) if rng.random() < 0.1 else None
        return Reaction(completion, 1.0, followup, False)

    fixed = Style(
        house.indent if "indent" in violated else style.indent,
        house.quote if "quote" in violated else style.quote,
    )
    region = task.render(fixed)
    region_lines = region.splitlines()
    kept = sum(line in region_lines for line in agent_lines)
    followup = None
    if rng.random() < 0.7:
        peeve = rng.choice(violated)
        template = rng.choice(ANNOYED[peeve])
        followup = template.format(indent=house.indent, quote_name="single" if house.quote == "'" else "double")
    return Reaction(region, kept / len(agent_lines), followup, followup is not None)
