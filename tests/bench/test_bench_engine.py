"""`rtrl bench engine` on a short run: the file it writes and the arithmetic of its ratios.

Rates are not asserted (noisy machines); that both sides generated the lengths asked
for, and that the ratios are the quotients of the rates the phases report, is."""

import json

from rich.console import Console

from rtrl.bench import report
from rtrl.bench.engine import run


def test_bench_engine_writes_consistent_results(tmp_path):
    out = tmp_path / "engine.json"
    results = run(
        out,
        Console(file=open(tmp_path / "log", "w")),
        concurrency=4,
        max_tokens=8,
        phase_s=0.5,
        rounds=1,
        swap_every_s=0.1,
        turns=(1, 3, 8, 8),
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(report.as_json(results)))
    phases = {p.name: p for p in results.phases}
    assert set(phases) == {
        "hf_generate",
        "engine_keep_steady",
        "engine_keep_swaps",
        "engine_recompute_steady",
        "engine_recompute_swaps",
    }
    for p in phases.values():
        assert p.tokens > 0 and p.tokens % 8 == 0  # every completion exactly max_tokens long
    assert phases["engine_keep_swaps"].swaps >= 1 and phases["engine_keep_steady"].swaps == 0
    rate = {name: p.tokens / p.seconds for name, p in phases.items()}
    assert abs(results.ratio - rate["engine_keep_steady"] / rate["hf_generate"]) < 0.01
    assert (
        abs(results.swap_slowdown - rate["engine_keep_swaps"] / rate["engine_keep_steady"]) < 0.01
    )
    turns = results.turns
    assert turns is not None and turns.turns == 3
    assert abs(turns.ratio - turns.resent_turn_s / turns.kept_turn_s) < 0.01
    # Every turn after the first resumed: its whole history but the last sampled token.
    assert turns.reused_positions == sum((t + 1) * 16 - 1 for t in range(2))
