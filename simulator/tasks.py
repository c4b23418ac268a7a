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

In the unique-prompts mode (``rtrl demo --unique-prompts``, UniqueTasks) every task
also carries a serial, part of the helper's name, so no two prompts are equal, as in
real traffic, where no two rollouts share a prompt to compare against:

    @p2 say hi 04821
    def say_hi_04821():
        print("hi")

Instead of an edit, the policy may ask a clarifying question about the house style
(``which indent does p2 use?``). The product shows it as a chat message, not as an
edit: nothing is applied, so nothing can persist.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rtrl.v1 import rollout_pb2

VERBS = ("say", "log", "warn", "show")
CALLS = {"say": "print", "log": "log.info", "warn": "log.warning", "show": "display"}
WORDS = ("hi", "ok", "done", "ready", "stop", "go", "yes", "no", "wait", "fail", "start", "saved")
INDENTS = (2, 4)
QUOTES = ("'", '"')
QUESTION_TOPICS = ("indent", "quotes")
SERIAL_DIGITS = 5
UNIQUE_MAX_TOKENS = 64
"""Completion budget of a task with a serial: its longest helper and EOS take 51 tokens,
more than the 48 that serving and the eval gate allow by default."""


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
    serial: str = ""
    """Digits that end the prompt and the helper's name, making the prompt unique; "" in the
    standard family."""

    @property
    def prompt(self) -> str:
        serial = f" {self.serial}" if self.serial else ""
        return f"@p{self.project} {self.verb} {self.word}{serial}\n"

    @property
    def helper(self) -> str:
        serial = f"_{self.serial}" if self.serial else ""
        return f"{self.verb}_{self.word}{serial}"

    def render(self, style: Style) -> str:
        """The correct completion in a given style."""
        pad = " " * style.indent
        q = style.quote
        return f"def {self.helper}():\n{pad}{CALLS[self.verb]}({q}{self.word}{q})\n"

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


def with_random_serial(task: Task, rng: random.Random) -> Task:
    """The task with a serial drawn at random (the warm start's and eval suite's unique tasks)."""
    return replace(task, serial=f"{rng.randrange(10**SERIAL_DIGITS):0{SERIAL_DIGITS}d}")


def serial_of(index: int) -> str:
    """The index-th serial: distinct for distinct indices, SERIAL_DIGITS digits for the first
    10**SERIAL_DIGITS (scrambled by a multiplier prime to 10, so every digit varies), more after."""
    if index < 10**SERIAL_DIGITS:
        return f"{index * 48_271 % 10**SERIAL_DIGITS:0{SERIAL_DIGITS}d}"
    return str(index)


class UniqueTasks:
    """Draws tasks like random_task, each with the next serial: no prompt is ever drawn twice
    by one instance (shared by every client of a simulated product)."""

    def __init__(self) -> None:
        self._next = itertools.count()

    def draw(self, rng: random.Random, project: int | None = None) -> Task:
        return replace(random_task(rng, project), serial=serial_of(next(self._next)))


def context_key(rollout: rollout_pb2.RolloutRecord) -> str:
    """The trainer's context key of a demo rollout (RTRL_TRAINER_CONTEXT_KEY): the project
    tag that opens its prompt, "" for a prompt without one."""
    tag = rollout.prompt_text.split(" ", 1)[0]
    return tag if tag.startswith("@p") else ""


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
