"""The agentic reward's effort penalty: a nonlinear curve over what a trajectory spent.

    units   = generated / tokens + tool_calls / calls + turns / turns_unit + observed / io
    penalty = min(cap, weight * units ** exponent)

Each term counts a resource against its unit: the tokens the policy generated, the tool
calls it made, its turns, and the tool I/O it read (observed tokens). A square, not a line:
a linear cost per token pays for cutting every answer short, the ones that needed their
length included, while a square leaves a short trajectory almost free and makes a wasteful
one (serial calls, a second lint, a runaway loop) cost more than its last step could buy.
The cap keeps the reward bounded.

On the demo agent (simulator/agent.py; the curve below): an answer written at once spends
about 1.1 units (0.01), reading both of p4's tools in one turn 3.3 (0.11), the warm start's
usual four serial calls 6.4 (0.41, most of the 0.5 cap). Reading in p4 is worth a full
persisted edit and no complaint, so it stays worth its cost; reading elsewhere never is.

A curve is part of a reward function's version: ``a1`` uses A1_EFFORT, and a configured
curve (RTRL_REWARD_EFFORT_CURVE) is a version of its own (reward.with_curve), so a reward id
always names the numbers that made it.
"""

from __future__ import annotations

import hashlib
import json

from pydantic import BaseModel, ConfigDict, Field

from rtrl.trajectory_summary import Summary

MIN_UNIT = 1e-3
"""The smallest a unit may be (a thousandth of a token, call or turn): any smaller and a
count divided by it leaves the floats a penalty is computed in."""
MAX_UNIT = 1e9


class EffortCurve(BaseModel):
    """The curve's numbers, each finite and bounded (checked when the joiner starts), so that
    the penalty of any trajectory a record can describe (every count up to 2**64) is a number
    within [0, cap]: at the steepest, (4 * 2**64 / 0.001) ** 4 * 100 is about 1e94, far from
    a float's 1e308. An exponent of 1e308 raised OverflowError on the first long trajectory
    and crash-looped the joiner."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    tokens: float = Field(64.0, ge=MIN_UNIT, le=MAX_UNIT)
    """Generated tokens per unit."""
    calls: float = Field(2.0, ge=MIN_UNIT, le=MAX_UNIT)
    """Tool calls per unit."""
    turns: float = Field(2.0, ge=MIN_UNIT, le=MAX_UNIT)
    """Assistant turns per unit."""
    io: float = Field(32.0, ge=MIN_UNIT, le=MAX_UNIT)
    """Observed tokens (the tools' answers) per unit."""
    weight: float = Field(0.01, ge=0, le=100)
    """The penalty of one unit (before the exponent)."""
    exponent: float = Field(2.0, ge=1, le=4)
    """How much steeper than a line: 2 is a square; past 4 a curve says nothing a cap does not."""
    cap: float = Field(0.5, ge=0, le=10)
    """The most any trajectory is charged: the agentic scalars lie within a few units of 0."""

    def units(self, summary: Summary) -> float:
        return (
            summary.generated_tokens / self.tokens
            + summary.tool_call_count / self.calls
            + summary.turns / self.turns
            + summary.observed_tokens / self.io
        )

    def penalty(self, summary: Summary) -> float:
        return min(self.cap, self.weight * self.units(summary) ** self.exponent)

    def digest(self) -> str:
        """Eight hex digits naming the curve's numbers."""
        text = json.dumps(self.model_dump(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:8]


A1_EFFORT = EffortCurve()
