"""The warm-start cache: trains once, then hits; the key follows the seed."""

from __future__ import annotations

from safetensors.torch import load_file

from rtrl.policy import PolicyConfig, build_model, load_weights, state_dict_fp32
from trainer.warmstart import WarmStartRecipe, cache_path, ensure_warm_start

TINY = PolicyConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_positions=64)
RECIPE = WarmStartRecipe(batch_size=8, warmup_steps=5, min_steps=30, max_steps=30)


def test_warm_start_trains_once_then_hits_the_cache(tmp_path):
    calls = []
    path = ensure_warm_start(tmp_path, lambda step, total, loss: calls.append((step, total, loss)), policy_config=TINY, recipe=RECIPE)
    assert path.exists() and path.parent == tmp_path / "cache" and path.name.startswith("warmstart-")
    assert [c[0] for c in calls] == list(range(1, 31)) and calls[-1][1] == 30
    assert calls[-1][2] < calls[0][2]  # the loss went down

    weights = load_file(str(path))
    model = build_model(TINY)
    assert set(weights) == set(state_dict_fp32(model))
    load_weights(model, weights)

    mtime = path.stat().st_mtime_ns
    calls.clear()
    assert ensure_warm_start(tmp_path, lambda *a: calls.append(a), policy_config=TINY, recipe=RECIPE) == path
    assert calls == [] and path.stat().st_mtime_ns == mtime
    assert [p.name for p in path.parent.iterdir() if ".tmp" in p.name] == []


def test_cache_key_follows_seed_and_model_shape(tmp_path):
    base = cache_path(tmp_path, TINY, RECIPE)
    assert cache_path(tmp_path, TINY, RECIPE) == base
    assert cache_path(tmp_path, TINY, WarmStartRecipe(batch_size=8, warmup_steps=5, min_steps=30, max_steps=30, seed=1)) != base
    assert cache_path(tmp_path, PolicyConfig(), RECIPE) != base
