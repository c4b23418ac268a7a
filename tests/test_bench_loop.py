"""When is a version live on every worker: the bench's definition, as cases."""

import pytest

from rtrl.bench_loop import VersionLatency, live_times, summarize


@pytest.mark.parametrize(
    "applied, expected",
    [
        # both workers apply every version: live when the slower one does
        ({1: {"a": 100, "b": 150}, 2: {"a": 200, "b": 210}}, {1: 150, 2: 210}),
        # worker b skips v1 and goes straight to v2: v1 is live on b from then on
        ({1: {"a": 100}, 2: {"a": 200, "b": 180}}, {1: 180, 2: 200}),
        # v3 only on one worker so far: not live on every worker
        ({2: {"a": 200, "b": 210}, 3: {"a": 300}}, {2: 210}),
    ],
)
def test_live_times(applied, expected):
    assert live_times(applied) == expected


def test_summary_quantiles_and_ratio():
    rows = [VersionLatency(v, 1000, 2000, 1000 + 1000 * v) for v in range(1, 11)]
    result = summarize(rows, versions_published=12, reward_window_s=2.0)
    assert result["p50_event_to_live_s"] == 5.5
    assert result["p95_event_to_live_s"] == 10.0
    assert result["versions_published"] == 12
    assert result["versions_live_on_every_worker"] == 10
    assert result["p50_event_to_live_vs_reward_window"] == 2.75
