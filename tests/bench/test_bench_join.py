"""`rtrl bench join` end to end on a tiny load: every key present, every rollout settled
exactly once by one worker and again by two, ratios positive. No timing is asserted."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from rtrl.bench import report
from rtrl.bench.join import Exactness, run

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KEYS = {
    "code",
    "rollouts",
    "events",
    "mean_event_bytes",
    "partitions",
    "spacing_ms",
    "window_s",
    "grace_s",
    "raw_consumer_events_per_s",
    "faust_floor_events_per_s",
    "joiner_inprocess_events_per_s",
    "events_per_s",
    "events_per_s_2_workers",
    "ratio_vs_floor",
    "floor_vs_raw",
    "scaleout_2_vs_1",
    "rate_source",
    "settle_events_per_s",
    "settle_events_per_s_2_workers",
    "rewards_1_worker",
    "rewards_2_workers",
    "exact_1_worker",
    "exact_2_workers",
    "join_1_worker",
    "join_2_workers",
    "partitions_2_workers",
    "live_rollouts",
    "live_rate_per_s",
    "latency_samples",
    "p50_settle_latency_s",
    "p99_settle_latency_s",
    "joiner_inprocess_signed_events_per_s",
    "signed_vs_unsigned_inprocess",
    "sign_us_per_reward",
    "verify_us_per_reward",
    "reward_bytes",
    "sign_us_per_rollout",
    "verify_us_per_rollout",
    "rollout_bytes",
    "rounds",
    "faust_floor_rounds",
    "events_per_s_rounds",
    "exact_1_worker_rounds",
    "trajectories",
}


def test_tiny_load_every_key_exact_counts(tmp_path):
    out = tmp_path / "join.json"
    # 20 ms apart so the 300 rollouts span 6 s of event time and most close by stream time.
    results = run(
        out,
        Console(width=120),
        rollouts=300,
        spacing_ms=20,
        live_rollouts=200,
        live_rate_per_s=50.0,
        rounds=2,
        trajectory_rollouts=40,
    )

    assert json.loads(out.read_text()) == json.loads(json.dumps(report.as_json(results)))
    assert set(report.as_json(results)) == KEYS
    rollouts = 300 + results.partitions + 200  # main load, one sentinel per partition, live
    assert results.events == 3 * (300 + results.partitions)
    assert results.rewards_1_worker == results.rewards_2_workers == rollouts
    for run_, exact, join in (
        ("1_worker", results.exact_1_worker, results.join_1_worker),
        ("2_workers", results.exact_2_workers, results.join_2_workers),
    ):
        assert exact == Exactness(missing=0, doubled=0), run_
        assert (join.settled, join.defaulted, join.late, join.dropped) == (rollouts, 0, 0, 0), run_
    assert (
        results.rounds == len(results.faust_floor_rounds) == len(results.events_per_s_rounds) == 2
    )
    assert results.exact_1_worker_rounds == (Exactness(0, 0), results.exact_1_worker)
    assert results.events_per_s == max(results.events_per_s_rounds)
    assert results.faust_floor_events_per_s == max(results.faust_floor_rounds)
    for key in (
        "raw_consumer_events_per_s",
        "faust_floor_events_per_s",
        "joiner_inprocess_events_per_s",
        "events_per_s",
        "events_per_s_2_workers",
        "ratio_vs_floor",
        "scaleout_2_vs_1",
        "settle_events_per_s",
        "settle_events_per_s_2_workers",
        "p50_settle_latency_s",
        "p99_settle_latency_s",
        "joiner_inprocess_signed_events_per_s",
        "sign_us_per_reward",
        "verify_us_per_reward",
        "sign_us_per_rollout",
        "verify_us_per_rollout",
    ):
        assert getattr(results, key) > 0, key
    assert results.latency_samples > 0
    single, *agents = results.trajectories
    assert [t.tokens for t in results.trajectories] == [0, 4096, 32768]
    for t in results.trajectories:
        assert (t.missing, t.doubled, t.rollouts) == (0, 0, 40), t
        assert t.events_per_s > 0 and t.pending_bytes > 0
    for t in agents:  # out of band: the joiner holds and forwards a small record
        assert t.record_bytes < 2_000 < 20 * t.record_bytes < t.whole_record_bytes
        assert t.reward_bytes < 2 * single.reward_bytes
        assert t.pending_bytes_inline > 2 * t.pending_bytes
