"""Simulated users: each works in one project and has a pet peeve about its house style.

A user keeps an edit whose style matches the house style on the dimensions they care
about; otherwise they rewrite the offending line (a later snapshot of the region
shows the agent's other lines still there) and often send an annoyed follow-up.
Users of the mixed project (p4, no house style) each have a style of their own (the
four styles in turn, so none is more common), care about both dimensions of it and
always complain about an edit in another style: the best any policy can do there is
guess, so an edit in p4 persists a quarter of the time and is complained about in the
other three. Under reward r1 that scores 0.25 - 0.02 effort = 0.23 on average, less
than the 0.5 r1 pays for asking instead; under r3 asking scores about 0. With the
usual complaint rate a guess would score 0.34 under r1, and asking's edge there
would be too small to outgrow, within minutes, the pull of the other projects where
asking always loses. A fifth of the users work in p4 (MIXED_SHARE): under r1 the
share of completions that ask then goes from about 7 % to 18 % (p4 alone: 25 % to
85 %), while the standard demo's A/B table still mostly measures the four projects
whose style can be learned.

Fewer users care about quotes than about indentation: in earlier runs the quote
choice was learned more slowly, and a product's users are rarely uniform anyway.

A clarifying question is not an edit: nothing is applied, so nothing persists. The
user answers it some of the time (ANSWER_RATE), plainly, naming the house style;
a question is not annoying, it just gets no work done.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rtrl.simulator.tasks import (
    MIXED_PROJECT,
    PROJECT_STYLES,
    Style,
    Task,
    is_question,
    parse_style,
)

PEEVES = ("indent", "quote")
# (peeves, share of users)
PEEVE_MIX = (
    (frozenset({"indent"}), 0.5),
    (frozenset({"quote"}), 0.2),
    (frozenset({"indent", "quote"}), 0.3),
)

ANNOYED = {
    "indent": (
        "no, use {indent}-space indent like the rest of the file",
        "wrong indentation again, this project uses {indent} spaces",
    ),
    "quote": (
        "no, we use {quote_name} quotes here",
        "why did you switch the quotes? revert to {quote_name} quotes",
    ),
    "broken": ("that's not valid code, it broke the build", "no, that is wrong, undo it"),
}
CONTENT = (
    "thanks, now add a test for it",
    "great, can you also add a docstring?",
    "ok, next do the same for errors",
)
ANSWERS = (
    "{indent} spaces and {quote_name} quotes",
    "this project uses {indent}-space indent with {quote_name} quotes",
)
ANSWER_RATE = 0.6
MIXED_SHARE = 0.2
"""Share of users working in the mixed project."""
COMPLAINT_RATE = 0.7
"""Chance of an annoyed follow-up to an edit in the wrong style (1.0 in the mixed project)."""


@dataclass(frozen=True)
class User:
    user_id: str
    project: int
    peeves: frozenset[str]
    privacy_mode: bool = False
    own_style: Style | None = None
    """The style a user of the mixed project insists on (None elsewhere)."""
    writes_style_down: bool = False
    """A mixed-project user whose editor configuration and files show their style, so an
    agent that reads them can tell it (the agentic product: simulator/agent.py); half of
    them do."""

    @property
    def written_style(self) -> Style | None:
        """What reading this user's configuration and files tells: their style if they write
        it down, else nothing (the projects with a house style leave it unwritten)."""
        return self.own_style if self.writes_style_down else None

    @property
    def house_style(self) -> Style:
        """The style this user expects: their project's, or their own in the mixed project."""
        return self.own_style or PROJECT_STYLES[self.project]


@dataclass(frozen=True)
class Reaction:
    """What the user's editor reports about one edit (or question)."""

    region_text: str | None
    """The edited region some time later; None when no edit was shown (a question)."""
    persisted_fraction: float
    followup: str | None
    dissatisfied: bool


def population(size: int, seed: int = 7, privacy_share: float = 0.0) -> list[User]:
    rng = random.Random(seed)
    users: list[User] = []
    for i in range(size):
        roll, acc = rng.random(), 0.0
        peeves = PEEVE_MIX[-1][0]
        for candidate, share in PEEVE_MIX:
            acc += share
            if roll < acc:
                peeves = candidate
                break
        project = (
            MIXED_PROJECT if rng.random() < MIXED_SHARE else rng.randrange(len(PROJECT_STYLES))
        )
        private = rng.random() < privacy_share
        if project == MIXED_PROJECT:
            mixed = sum(u.project == MIXED_PROJECT for u in users)
            own = PROJECT_STYLES[mixed % len(PROJECT_STYLES)]
            written = mixed // len(PROJECT_STYLES) % 2 == 0
            users.append(
                User(
                    f"user-{seed}-{i:04d}",
                    project,
                    frozenset(PEEVES),
                    private,
                    own_style=own,
                    writes_style_down=written,
                )
            )
        else:
            users.append(User(f"user-{seed}-{i:04d}", project, peeves, private))
    return users


def react(user: User, task: Task, completion: str, rng: random.Random) -> Reaction:
    """The user's hidden judgement of an edit. The policy only ever sees its consequences."""
    house = user.house_style
    quote_name = "single" if house.quote == "'" else "double"
    if is_question(completion):
        answer = (
            rng.choice(ANSWERS).format(indent=house.indent, quote_name=quote_name)
            if rng.random() < ANSWER_RATE
            else None
        )
        return Reaction(None, 0.0, answer, False)
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
    if rng.random() < (1.0 if user.own_style else COMPLAINT_RATE):
        peeve = rng.choice(violated)
        template = rng.choice(ANNOYED[peeve])
        followup = template.format(indent=house.indent, quote_name=quote_name)
    return Reaction(region, kept / len(agent_lines), followup, followup is not None)
