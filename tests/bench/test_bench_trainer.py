"""`rtrl bench trainer` on a tiny run: what it writes, and that its bare loop trains the
same objective as rl_step (same loss on the same weights), so the comparison is fair."""

import copy
import json

import torch
from rich.console import Console

from rtrl.bench import report
from rtrl.bench.trainer import plain_step, production_batch, run
from rtrl.policy import build_model
from rtrl.trainer.objective import leave_one_out_advantages
from rtrl.trainer.step import build_optimizer, rl_step


def test_bench_trainer_writes_its_ratio(tmp_path):
    out = tmp_path / "trainer.json"
    results = run(
        out,
        Console(file=open(tmp_path / "log", "w")),
        batch_size=8,
        max_tokens=6,
        steps=1,
        rounds=1,
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(report.as_json(results)))
    assert results.completion_tokens_per_step == 8 * 6 and results.steps == 1
    assert (
        abs(results.overhead_ratio - results.tokens_per_s / results.plain_loop_tokens_per_s) < 0.01
    )


def test_the_bare_loop_takes_the_same_step_as_rl_step():
    batch = production_batch(8, 6)
    base = build_model(seed=1)
    ref = copy.deepcopy(base).eval()
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    rl_step(
        a, build_optimizer(a, 1e-3), batch, ref_model=ref, kl_coef=0.01, is_cap=2.0, grad_clip=1.0
    )
    advantages = torch.tensor(
        leave_one_out_advantages(batch.rewards, batch.groups, std_normalize=False),
        dtype=torch.float32,
    )
    plain_step(b, ref, build_optimizer(b, 1e-3), batch, advantages, 0.01, 1.0)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=1e-5, msg=name)
    assert any(
        not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), base.parameters(), strict=True)
    )
