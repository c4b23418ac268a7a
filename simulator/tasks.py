"""The product's task family: tiny Python helper functions in a project's house style.

A prompt names the project (a tag at a fixed position) and the helper to write:

    @p2 say hi
    def say_hi():
        print("hi")

Projects p0–p3 each have a house style — indent width and quote character — that
their users expect. The policy never sees the style, only the project tag; it learns
the style from whether users keep its edits. Both style choices hinge on a single
token, the kind of preference the policy can learn from reward within a couple of
minutes. Project p4 (MIXED_PROJECT) has no house style: each of its users insists
on their own (simulator/users.py), so no style is safe there and every edit is a
gamble, the "risky edit" a policy may learn to dodge.

Instead of an edit, the policy may ask a clarifying question about the house style
(``which indent does p2 use?``). The product shows it as a chat message, not as an
edit: nothing is applied, so nothing can persist.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

VERBS = ("say", "log", "warn", "show")
CALLS = {"say": "print", "log": "log.info", "warn": "log.warning", "show": "display"}
WORDS = ("hi", "ok", "done", "ready", "stop", "go", "yes", "no", "wait", "fail", "start", "saved")
INDENTS = (2, 4)
QUOTES = ("'", '"')
QUESTION_TOPICS = ("indent", "quotes")


@dataclass(frozen=True)
class Style:
    indent: int
    quote: str


# House style of projects p0-p3; together they cover every combination.
PROJECT_STYLES = (Style(2, "'"), Style(4, "'"), Style(2, '"'), Style(4, '"'))
MIXED_PROJECT = len(PROJECT_STYLES)
PROJECTS = MIXED_PROJECT + 1


@dataclass(frozen=True)
class Task:
    project: int
    verb: str
    word: str

    @property
    def prompt(self) -> str:
        return f"@p{self.project} {self.verb} {self.word}\n"

    def render(self, style: Style) -> str:
        """The correct completion in a given style."""
        pad = " " * style.indent
        q = style.quote
        return f"def {self.verb}_{self.word}():\n{pad}{CALLS[self.verb]}({q}{self.word}{q})\n"

    def lines_in(self, style: Style) -> list[str]:
        return self.render(style).splitlines()

    def question(self, topic: str) -> str:
        """A clarifying question about one style dimension of the task's project."""
        return f"which {topic} does p{self.project} use?"


def random_task(rng: random.Random, project: int | None = None) -> Task:
    return Task(
        project=rng.randrange(PROJECTS) if project is None else project,
        verb=rng.choice(VERBS),
        word=rng.choice(WORDS),
    )


def random_style(rng: random.Random) -> Style:
    return Style(rng.choice(INDENTS), rng.choice(QUOTES))


def is_question(completion: str) -> bool:
    """How the product tells a question from an edit: it ends with "?" and writes no helper."""
    return completion.strip().endswith("?") and "def " not in completion


def parse_style(task: Task, completion: str) -> Style | None:
    """The style a completion is written in, or None if it is not a correct helper."""
    for indent in INDENTS:
        for quote in QUOTES:
            style = Style(indent, quote)
            if completion.rstrip("\n") == task.render(style).rstrip("\n"):
                return style
    return None
