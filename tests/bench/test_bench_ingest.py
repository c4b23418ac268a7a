"""`rtrl bench ingest` on a small run: it writes both rates and their ratio, and its
exactness check is real (every event it sent through the gateway and the bare
producer is on the topics once)."""

import json

import pytest
from rich.console import Console

from rtrl.bench import report
from rtrl.bench.ingest import EVENT_BYTES, make_events, run

pytestmark = pytest.mark.integration


def test_bench_ingest_writes_rates_ratio_and_exactness(tmp_path):
    out = tmp_path / "ingest.json"
    result = run(
        out,
        Console(file=open(tmp_path / "log", "w")),
        events_per_round=3_000,
        batch=250,
        concurrency=4,
        rounds=1,
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(report.as_json(result)))
    assert result.exact and result.sent == result.landed == 6_000 and result.not_accepted == 0
    assert result.events_per_s > 0 and result.raw_producer_events_per_s > 0
    assert result.ratio == pytest.approx(
        result.events_per_s / result.raw_producer_events_per_s, abs=1e-3
    )


def test_bench_events_are_realistic_and_distinct():
    events = make_events(100)
    sizes = {len(e.SerializeToString()) for e in events}
    assert min(sizes) > 0.85 * EVENT_BYTES and max(sizes) <= EVENT_BYTES
    assert len({e.event_id for e in events}) == 100 and len({e.rollout_id for e in events}) == 25
