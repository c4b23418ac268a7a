"""The warm-start cache: trains once, then hits; the key follows the seed. The corpus:
balanced styles, a few clarifying questions."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from rtrl.checkpoint import Checkpoint
from rtrl.policy import (
    BOS,
    PolicyConfig,
    build_model,
    encode,
    load_weights,
    state_dict_fp32,
    weights_digest,
)
from rtrl.simulator.tasks import (
    MIXED_PROJECT,
    PROJECT_STYLES,
    QUESTION_TOPICS,
    is_question,
    parse_style,
)
from rtrl.simulator.warmstart import (
    WarmStartRecipe,
    batch_rows,
    cache_path,
    ensure_warm_start,
    load_warm_start,
)

TINY = PolicyConfig(
    hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_positions=64
)
RECIPE = WarmStartRecipe(batch_size=8, warmup_steps=5, min_steps=30, max_steps=30)


def test_warm_start_trains_once_then_hits_the_cache(tmp_path):
    calls = []
    path = ensure_warm_start(
        tmp_path,
        lambda step, total, loss: calls.append((step, total, loss)),
        policy_config=TINY,
        recipe=RECIPE,
    )
    assert (
        path.exists() and path.parent == tmp_path / "cache" and path.name.startswith("warmstart-")
    )
    assert [c[0] for c in calls] == list(range(1, 31)) and calls[-1][1] == 30
    assert calls[-1][2] < calls[0][2]  # the loss went down

    weights = load_warm_start(path)
    model = build_model(TINY)
    assert set(weights) == set(state_dict_fp32(model))
    load_weights(model, weights)

    # One loading path: the warm start is a model directory like any user's checkpoint.
    policy = Checkpoint.open(path)
    assert policy.encode("def f(): pass") == [BOS, *encode("def f(): pass")]
    assert weights_digest(state_dict_fp32(policy.load_model())) == weights_digest(
        state_dict_fp32(model)
    )

    mtime = path.stat().st_mtime_ns
    calls.clear()
    assert (
        ensure_warm_start(tmp_path, lambda *a: calls.append(a), policy_config=TINY, recipe=RECIPE)
        == path
    )
    assert calls == [] and path.stat().st_mtime_ns == mtime
    assert [p.name for p in path.parent.iterdir() if ".tmp" in p.name] == []


def test_cache_key_follows_seed_and_model_shape(tmp_path):
    base = cache_path(tmp_path, TINY, RECIPE)
    assert cache_path(tmp_path, TINY, RECIPE) == base
    assert (
        cache_path(
            tmp_path,
            TINY,
            WarmStartRecipe(batch_size=8, warmup_steps=5, min_steps=30, max_steps=30, seed=1),
        )
        != base
    )
    assert cache_path(tmp_path, PolicyConfig(), RECIPE) != base


def test_batch_keeps_styles_balanced_and_asks_mostly_in_the_mixed_project():
    recipe = WarmStartRecipe()
    rng = random.Random(0)
    batches = [batch_rows(rng, recipe) for _ in range(200)]
    assert all(len(rows) == recipe.batch_size for rows in batches)
    questions = [(task, text) for rows in batches for task, text in rows if is_question(text)]
    assert len(questions) == 200 * recipe.question_rows
    assert all(
        text in {task.question(topic) for topic in QUESTION_TOPICS} for task, text in questions
    )
    # Every helper task comes in all four styles, so style marginals are exact per batch.
    for rows in batches:
        styles = Counter(parse_style(task, text) for task, text in rows if not is_question(text))
        assert set(styles) == set(PROJECT_STYLES) and len(set(styles.values())) == 1
    mixed = sum(task.project == MIXED_PROJECT for task, _ in questions) / len(questions)
    assert abs(mixed - recipe.mixed_question_share) < 0.05


@pytest.mark.parametrize("batch_size, question_rows", [(64, 3), (8, 8), (8, -4)])
def test_recipe_needs_whole_helper_tasks(batch_size, question_rows):
    with pytest.raises(ValueError):
        WarmStartRecipe(batch_size=batch_size, question_rows=question_rows)
