"""The product's unique-prompts mode: no prompt is ever asked twice, and a task with a serial
is still one the users, the warm start and the eval suite can judge."""

from __future__ import annotations

import random

import pytest

from rtrl.policy import encode
from rtrl.simulator.product import Product
from rtrl.simulator.suite import demo_suite, unique_prompt_suite
from rtrl.simulator.tasks import (
    CALLS,
    INDENTS,
    PROJECT_STYLES,
    PROJECTS,
    QUOTES,
    SERIAL_DIGITS,
    UNIQUE_MAX_TOKENS,
    VERBS,
    WORDS,
    Style,
    Task,
    UniqueTasks,
    context_key,
    parse_style,
    random_task,
    serial_of,
)
from rtrl.simulator.warmstart import WarmStartRecipe, batch_rows
from rtrl.v1 import rollout_pb2


def test_unique_tasks_never_repeat_a_prompt():
    """Past the 10**SERIAL_DIGITS serials of fixed width too, and across the clients sharing one."""
    tasks = UniqueTasks()
    clients = [random.Random(seed) for seed in range(8)]
    drawn = 10**SERIAL_DIGITS + 5_000
    prompts = {
        tasks.draw(clients[i % len(clients)], project=i % PROJECTS).prompt for i in range(drawn)
    }
    assert len(prompts) == drawn


def test_serials_are_fixed_width_digits_that_all_vary():
    first = [serial_of(i) for i in range(1000)]
    assert all(len(s) == SERIAL_DIGITS and s.isdigit() for s in first)
    assert all(len({s[d] for s in first}) == 10 for d in range(SERIAL_DIGITS))
    assert serial_of(10**SERIAL_DIGITS) == str(10**SERIAL_DIGITS)


def test_the_standard_family_is_unchanged():
    task = Task(project=2, verb="say", word="hi")
    assert task.prompt == "@p2 say hi\n"
    assert task.render(Style(4, '"')) == 'def say_hi():\n    print("hi")\n'


def test_a_serial_names_the_helper_and_only_its_helper_parses():
    task = Task(project=2, verb="say", word="hi", serial="04821")
    assert task.prompt == "@p2 say hi 04821\n"
    for style in PROJECT_STYLES:
        assert parse_style(task, task.render(style)) == style
    assert parse_style(task, Task(2, "say", "hi").render(PROJECT_STYLES[0])) is None
    assert parse_style(task, Task(2, "say", "hi", "04822").render(PROJECT_STYLES[0])) is None


def test_the_longest_unique_helper_fits_its_token_budget_and_not_the_default():
    longest = max(
        len(encode(Task(0, verb, word, "9" * SERIAL_DIGITS).render(Style(indent, quote)))) + 1
        for verb in CALLS
        for word in WORDS
        for indent in INDENTS
        for quote in QUOTES
    )
    assert 48 < longest <= UNIQUE_MAX_TOKENS


def test_context_key_is_the_project_tag():
    task = Task(project=3, verb="log", word="ok", serial="00017")
    assert context_key(rollout_pb2.RolloutRecord(prompt_text=task.prompt)) == "@p3"
    assert context_key(rollout_pb2.RolloutRecord(prompt_text="no tag here")) == ""


def test_the_product_draws_unique_prompts_only_when_asked():
    unique = Product(["http://127.0.0.1:1"], "http://127.0.0.1:1", unique_prompts=True)
    standard = Product(["http://127.0.0.1:1"], "http://127.0.0.1:1")
    assert standard.unique_tasks is None
    assert unique.unique_tasks is not None
    rng = random.Random(0)
    prompts = [unique.unique_tasks.draw(rng, project=0).prompt for _ in range(1000)]
    assert len(set(prompts)) == len(prompts)


def test_the_warm_start_and_eval_suite_of_unique_mode_have_serials():
    recipe = WarmStartRecipe(unique_prompts=True)
    assert all(task.serial for task, _ in batch_rows(random.Random(0), recipe))
    assert not any(task.serial for task, _ in batch_rows(random.Random(0), WarmStartRecipe()))
    suite = unique_prompt_suite(tasks=64, max_new_tokens=48)
    assert all(task.serial for task in suite.tasks)
    assert suite.max_new_tokens == UNIQUE_MAX_TOKENS
    assert not any(task.serial for task in demo_suite(tasks=64, max_new_tokens=48).tasks)


@pytest.mark.parametrize("seed", [0, 1])
def test_standard_draws_are_what_they_were(seed):
    """The standard mode consumes the random stream as before: the demo's runs stay comparable."""
    rng = random.Random(seed)
    expected = random.Random(seed)
    for _ in range(50):
        task = random_task(rng)
        project = expected.randrange(PROJECTS)
        verb = expected.choice(VERBS)
        word = expected.choice(WORDS)
        assert (task.project, task.verb, task.word, task.serial) == (project, verb, word, "")
