"""The sharded step takes rl_step's optimizer step: two gloo ranks under torchrun
follow the one-process loss curve and end at the same weights, and each rank's share
of the objective adds up to the one-process gradient (including a rank with no rows),
where the naive per-rank normalization does not.

Tolerance: the split changes only the order of float32 reductions (matmuls over fewer
rows, the two ranks' partial gradients summed by FSDP, the global norm from two
shards' norms). Measured over ten steps the curves differ by at most 3e-7 and the
final weights by 3e-7; TOLERANCE = 1e-5 leaves room for other BLAS builds, while the
naive per-rank normalization is off by 30% of the gradient's norm.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rtrl.policy import build_model, state_dict_fp32
from rtrl.simulator.sharded_run import GRAD_CLIP, IS_CAP, KL_COEF, synthetic_batches
from rtrl.trainer.distributed import World, local_objective, row_range
from rtrl.trainer.objective import leave_one_out_advantages, policy_gradient_loss
from rtrl.trainer.step import rl_step, token_logprobs

TOLERANCE = 1e-5
STEPS = 10
REPO = Path(__file__).resolve().parents[2]
CURVES = ("losses", "grad_norms", "kl", "entropy", "clipped_fraction", "ratio_mean")


@pytest.mark.parametrize(
    "rows, world_size, expected",
    [
        (8, 2, [(0, 4), (4, 8)]),
        # Uneven: the first ranks take the extra rows.
        (5, 2, [(0, 3), (3, 5)]),
        (7, 3, [(0, 3), (3, 5), (5, 7)]),
        # Fewer rows than ranks: the last ranks get none.
        (1, 2, [(0, 1), (1, 1)]),
        (2, 4, [(0, 1), (1, 2), (2, 2), (2, 2)]),
    ],
)
def test_rows_are_split_contiguously_and_evenly(rows, world_size, expected):
    assert [row_range(rows, World(rank, world_size)) for rank in range(world_size)] == expected


@pytest.fixture(scope="module")
def batches():
    """Rows 8, 5 and 1: an even split, an uneven one, and a rank with no rows."""
    return synthetic_batches(build_model(seed=0), 3, seed=0)


def _one_process_gradient(policy, ref, batch):
    """rl_step's gradient and metrics, with the optimizer and clipping made inert."""
    model = copy.deepcopy(policy)
    metrics = rl_step(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        batch,
        ref_model=ref,
        is_cap=IS_CAP,
        kl_coef=KL_COEF,
        grad_clip=math.inf,
    )
    return {name: p.grad for name, p in model.named_parameters()}, metrics


@pytest.mark.parametrize("index", [0, 1, 2], ids=["8-rows", "5-rows", "1-row"])
def test_rank_shares_add_up_to_the_one_process_gradient(batches, index):
    batch = batches[index]
    policy, ref = (
        build_model(seed=0),
        build_model(seed=1),
    )  # a different reference, so the KL term acts
    expected, metrics = _one_process_gradient(policy, ref, batch)

    model = copy.deepcopy(policy).train()
    advantages = torch.tensor(leave_one_out_advantages(batch.rewards, batch.groups))
    sums = torch.zeros(5, dtype=torch.float64)
    for rank in range(2):
        local = local_objective(
            model, batch, advantages, World(rank, 2), ref_model=ref, is_cap=IS_CAP, kl_coef=KL_COEF
        )
        local.loss.backward()  # gradients accumulate: the sum FSDP's reduction takes
        sums += local.sums
    # FSDP averages over the two ranks.
    grads = {name: p.grad / 2 for name, p in model.named_parameters()}
    for name, grad in grads.items():
        # Entries are at most ~4e-2 and differ by at most ~6e-9 here.
        torch.testing.assert_close(grad, expected[name], atol=1e-7, rtol=TOLERANCE, msg=name)
    norm = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])
    ).item()
    assert norm == pytest.approx(metrics.grad_norm, rel=TOLERANCE)
    loss, kl, clipped, ratio, entropy = (sums / metrics.tokens).tolist()
    assert [loss, kl, clipped, ratio, entropy] == pytest.approx(
        [metrics.loss, metrics.kl, metrics.clipped_fraction, metrics.ratio_mean, metrics.entropy],
        abs=TOLERANCE,
    )
    assert abs(metrics.kl) > 0.01 and metrics.clipped_fraction > 0


def test_per_rank_normalization_would_be_caught(batches):
    """Each rank backpropagating its own token mean (FSDP then averaging) weights the
    tokens of the rank with fewer of them more: far outside the tolerance."""
    batch = batches[1]
    policy, ref = build_model(seed=0), build_model(seed=1)
    expected, _ = _one_process_gradient(policy, ref, batch)
    model = copy.deepcopy(policy).train()
    advantages = torch.tensor(leave_one_out_advantages(batch.rewards, batch.groups))
    for rank in range(2):
        start, stop = row_range(len(batch.rewards), World(rank, 2))
        rows = batch.select(range(start, stop))
        logp, _ = token_logprobs(model, rows)
        with torch.no_grad():
            ref_logp, _ = token_logprobs(ref, rows)
        terms = policy_gradient_loss(
            logp,
            rows.behaviour_logprobs,
            advantages[start:stop],
            rows.target_mask,
            ref_logp=ref_logp,
            is_cap=IS_CAP,
            kl_coef=KL_COEF,
        )
        (terms.loss / 2).backward()
    naive = torch.cat([p.grad.flatten() for p in model.parameters()])
    right = torch.cat([expected[name].flatten() for name, _ in model.named_parameters()])
    assert ((naive - right).norm() / right.norm()).item() > 0.1


def _run(command: list[str], tmp: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    out, weights = tmp / "metrics.json", tmp / "weights.safetensors"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    }
    env["OMP_NUM_THREADS"] = "1"
    args = [
        "-m",
        "rtrl.simulator.sharded_run",
        "--steps",
        str(STEPS),
        "--out",
        str(out),
        "--weights",
        str(weights),
    ]
    done = subprocess.run(
        [sys.executable, *command, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()), load_file(weights)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same ten steps on one process (rl_step) and on two gloo ranks (sharded_rl_step)."""
    one = _run([], tmp_path_factory.mktemp("one"))
    two = _run(
        ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"],
        tmp_path_factory.mktemp("two"),
    )
    return one, two


@pytest.mark.slow
def test_two_ranks_follow_the_one_process_curves(runs):
    (one, _), (two, _) = runs
    assert (one["world_size"], two["world_size"]) == (1, 2)
    # Uneven splits and a batch of one row (a rank with none) are among the steps.
    assert one["rows"] == two["rows"] and 5 in one["rows"] and 1 in one["rows"]
    assert one["tokens"] == two["tokens"]
    for curve in CURVES:
        gap = max(abs(a - b) for a, b in zip(one[curve], two[curve], strict=True))
        assert gap <= TOLERANCE, f"{curve} differs by {gap:.2e}"


@pytest.mark.slow
def test_two_ranks_end_at_the_same_weights(runs):
    (one, weights_one), (two, weights_two) = runs
    assert two["weight_keys"] == one["weight_keys"] == list(state_dict_fp32(build_model()))
    for name, tensor in weights_one.items():
        torch.testing.assert_close(weights_two[name], tensor, atol=TOLERANCE, rtol=0, msg=name)


@pytest.mark.slow
def test_the_compared_run_is_not_trivial(runs):
    """Weights move by far more than the tolerance, the loss changes from step to step,
    the KL and the importance ratio's truncation act, and clipping binds on some steps."""
    (one, _), _ = runs
    assert one["weight_change_l2"] > 1.0
    assert max(one["losses"]) - min(one["losses"]) > 0.5
    assert max(abs(k) for k in one["kl"][1:]) > 0.1
    assert max(one["clipped_fraction"]) > 0.05
    assert sum(g > GRAD_CLIP for g in one["grad_norms"]) >= 3
