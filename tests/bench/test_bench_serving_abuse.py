"""`rtrl bench serving-abuse` on a small run: the attacker's over-context turns are
refused, its dropped streams are aborted, the neighbour is served throughout, and the
worker holds none of the attacker's trajectories afterwards. Latencies are reported, not
asserted."""

import json

import pytest
from rich.console import Console

from rtrl.bench.serving_abuse import run

pytestmark = pytest.mark.integration


def test_bench_serving_abuse_serves_the_neighbour_and_writes_its_results(tmp_path):
    out = tmp_path / "abuse.json"
    result = run(
        out,
        Console(file=open(tmp_path / "log", "w")),
        over_context=20,
        dropped=10,
        drop_rate_per_s=10.0,
        probes=5,
    )
    assert json.loads(out.read_text()) == result
    h1, m1 = result["h1"], result["m1"]
    assert h1["over_context_statuses"] == {"400": 20}
    assert h1["neighbour_after"]["statuses"] == [200, 200, 200]
    assert h1["open_trajectories_after"] <= 1  # a dropped stream answered before its drop
    assert set(m1["neighbour_statuses"]) == {"200"}
    assert result["quiet"]["statuses"] == {"200": 15}
    assert m1["p99_ratio"] > 0 and m1["most_running"] >= 1
