"""`rtrl status` tables render every state a component can report, including 'just started'."""

import pytest
from rich.console import Console

from rtrl.health import ComponentHealth
from rtrl.status_view import workers_table


@pytest.mark.parametrize(
    "trainer_status, shown",
    [
        # before the first step the trainer has no reward mean yet
        ({"step": 0, "version": 0, "reward_mean": None, "dropped_stale": 0}, "reward mean –"),
        ({"step": 12, "version": 12, "reward_mean": 0.8125, "dropped_stale": 3}, "reward mean 0.812"),
        # a heartbeat without the optional fields
        ({}, "step 0"),
    ],
)
def test_workers_table(trainer_status, shown):
    rows = [
        ComponentHealth("trainer:0", True, "", trainer_status),
        ComponentHealth("inference:0", True, "", {"versions": {"control": 0, "treatment": 7}, "completions": 5, "swaps": 7}),
    ]
    console = Console(record=True, width=200)
    console.print(workers_table(rows))
    text = console.export_text()
    assert shown in text
    assert "inference:0" in text and "7" in text
