"""The codec benchmark's yardsticks, on cases small enough to compute by hand."""

import math

import pytest
import torch

from rtrl.bench.codec import measure, order0_bound_bytes


def test_order0_bound_by_hand():
    old = {"w": torch.zeros(8, dtype=torch.float32)}
    new = {"w": old["w"].clone()}
    new["w"][2] = 1.0
    new["w"][5] = 1.0  # the same XOR pattern twice: the values carry no information
    bound, changed = order0_bound_bytes(old, new)
    assert changed == 0.25
    h = -(0.25 * math.log2(0.25) + 0.75 * math.log2(0.75))
    assert bound == pytest.approx(8 * h / 8)


def test_order0_bound_counts_value_entropy():
    old = {"w": torch.zeros(4, dtype=torch.bfloat16)}
    new = {"w": torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16)}
    bound, changed = order0_bound_bytes(old, new)
    assert changed == 1.0
    assert bound == pytest.approx(4 * 2 / 8)  # four distinct values: 2 bits each, positions free


def test_measure_round_trips_a_sparse_delta():
    torch.manual_seed(0)
    parent = {"a": torch.randn(4096), "b": torch.randn(64, 64).to(torch.bfloat16)}
    new = {k: v.clone() for k, v in parent.items()}
    new["a"][::97] += 1e-3
    new["b"][3, ::7] = 0.5
    result = measure(parent, new, repeats=1)
    assert result.delta_bytes < result.full_bytes / 10
    assert 0 < result.changed_fraction < 0.05
    assert result.entropy_bound_ratio is not None and result.entropy_bound_ratio > 1
