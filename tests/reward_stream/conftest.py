"""Fixtures of the reward-stream tests (the join, the reward functions, the monitors, the
joiner service). Scenarios and topic readers are plain functions in support/reward_stream.py."""

import pytest

from rtrl.reward_stream import reward, signals


@pytest.fixture
def rule_dissatisfaction(monkeypatch):
    """Follow-ups scored by the rules (1.0 / 0.0) instead of the trained classifier: the
    numbers are computable by hand, and the classifier's encoder is never loaded."""
    monkeypatch.setattr(
        reward,
        "dissatisfaction",
        lambda messages: [float(signals.is_dissatisfied(m)) for m in messages],
    )
