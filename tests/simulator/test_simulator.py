"""The simulated users' hidden judgement, as a table of cases."""

import random

import pytest

from rtrl.reward_stream.signals import is_dissatisfied
from rtrl.simulator.tasks import (
    MIXED_PROJECT,
    PROJECT_STYLES,
    Style,
    Task,
    is_question,
    parse_style,
    random_task,
)
from rtrl.simulator.users import ANSWER_RATE, User, population, react

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
    outcomes = [
        react(user, TASK, "def say_hi(:\n  prin('hi'\n", random.Random(s)) for s in range(200)
    ]
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
    assert {u.project for u in a} == {0, 1, 2, 3, MIXED_PROJECT}
    assert len({u.peeves for u in a if u.project != MIXED_PROJECT}) == 3
    mixed = [u for u in a if u.project == MIXED_PROJECT]
    # Each mixed-project user insists on a style of their own, on both dimensions, and no
    # style is more common than another by more than one user.
    assert all(u.own_style in PROJECT_STYLES and u.peeves == {"indent", "quote"} for u in mixed)
    counts = [sum(u.own_style == style for u in mixed) for style in PROJECT_STYLES]
    assert max(counts) - min(counts) <= 1
    assert all(u.own_style is None for u in a if u.project != MIXED_PROJECT)


QUESTION_CASES = {
    "the_warm_start_question": (TASK.question("indent"), True),
    "any_question_without_a_helper": ("which file should I edit?", True),
    "a_helper": (TASK.render(HOUSE), False),
    "a_helper_then_a_question": (TASK.render(HOUSE) + "like this?", False),
    "not_a_question": ("which indent does p1 use", False),
}


@pytest.mark.parametrize("completion, expected", QUESTION_CASES.values(), ids=QUESTION_CASES.keys())
def test_is_question(completion, expected):
    assert is_question(completion) is expected


def test_a_question_is_no_edit_and_answered_plainly_some_of_the_time():
    user = User("u", 1, frozenset({"indent", "quote"}))
    outcomes = [react(user, TASK, TASK.question("quotes"), random.Random(s)) for s in range(400)]
    # Nothing was applied, so nothing can be snapshotted or persist; a question never annoys.
    assert all(
        o.region_text is None and o.persisted_fraction == 0.0 and not o.dissatisfied
        for o in outcomes
    )
    answers = [o.followup for o in outcomes if o.followup]
    assert abs(len(answers) / len(outcomes) - ANSWER_RATE) < 0.08
    # The answer names the house style and reads as neutral to the reward's rules.
    assert all("4" in a and "single" in a and not is_dissatisfied(a) for a in answers)


def test_mixed_project_users_keep_only_their_own_style_and_always_complain():
    task = Task(project=MIXED_PROJECT, verb="say", word="hi")
    user = User("u", MIXED_PROJECT, frozenset({"indent", "quote"}), own_style=Style(2, '"'))
    for style in PROJECT_STYLES:
        outcomes = [react(user, task, task.render(style), random.Random(s)) for s in range(50)]
        if style == user.own_style:
            assert all(o.persisted_fraction == 1.0 and not o.dissatisfied for o in outcomes)
        else:
            assert all(o.persisted_fraction == 0.5 and o.dissatisfied for o in outcomes)
