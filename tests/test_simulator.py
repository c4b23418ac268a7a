"""The simulated users' hidden judgement, as a table of cases."""

import random

import pytest

from simulator.tasks import PROJECT_STYLES, Style, Task, parse_style, random_task
from simulator.users import User, population, react

TASK = Task(project=1, verb="say", word="hi")  # project 1: 4-space indent, single quotes
HOUSE = PROJECT_STYLES[1]


@pytest.mark.parametrize(
    "peeves, style, persisted, can_complain",
    [
        # house style on every dimension: kept whole, never an annoyed follow-up
        ({"indent", "quote"}, HOUSE, 1.0, False),
        # wrong quotes, but this user only cares about indentation
        ({"indent"}, Style(4, '"'), 1.0, False),
        # wrong indent for an indent-peeve user: the body line is rewritten
        ({"indent"}, Style(2, "'"), 0.5, True),
        # both wrong for a user who cares about both: still only the body line differs
        ({"indent", "quote"}, Style(2, '"'), 0.5, True),
    ],
)
def test_reaction_to_styles(peeves, style, persisted, can_complain):
    user = User("u", 1, frozenset(peeves))
    completion = TASK.render(style)
    outcomes = [react(user, TASK, completion, random.Random(seed)) for seed in range(50)]
    assert all(o.persisted_fraction == persisted for o in outcomes)
    assert any(o.dissatisfied for o in outcomes) == can_complain
    if persisted == 1.0:
        assert all(o.region_text == completion for o in outcomes)


def test_broken_completion_is_rewritten_and_usually_annoys():
    user = User("u", 1, frozenset({"quote"}))
    outcomes = [react(user, TASK, "def say_hi(:\n  prin('hi'\n", random.Random(s)) for s in range(200)]
    assert all(o.persisted_fraction == 0.0 for o in outcomes)
    assert 0.6 < sum(o.dissatisfied for o in outcomes) / len(outcomes) < 0.95


def test_render_parse_round_trip():
    rng = random.Random(0)
    for _ in range(100):
        task = random_task(rng)
        for style in PROJECT_STYLES:
            assert parse_style(task, task.render(style)) == style
    assert parse_style(TASK, "def say_hi():\n   print('hi')\n") is None


def test_population_is_deterministic_and_mixed():
    a, b = population(400, seed=3), population(400, seed=3)
    assert a == b
    peeve_sets = {u.peeves for u in a}
    assert len(peeve_sets) == 3
    assert {u.project for u in a} == {0, 1, 2, 3}

