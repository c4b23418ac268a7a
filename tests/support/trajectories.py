"""Trajectories shared by the tests that read and write records (rtrl/trajectory.py,
rtrl/bulk.py)."""

from __future__ import annotations

from rtrl.trajectory import Link, LinkReason, Segment, ToolCall, Trajectory

AGENT = Trajectory(
    prompt_ids=(1, 2),
    segments=(
        Segment.generated((3, 4), (-0.25, -0.5), (7, 7)),  # turn 0: two calls in parallel
        Segment.observed((5, 6), source="tool"),
        Segment.generated((8,), (-0.125,), (8,)),  # turn 1, sampled after a swap: one call
        Segment.observed((9,), source="tool"),
        Segment.generated((10, 11), (-1.0, -2.0), (8, 9)),  # turn 2: swapped mid-turn
    ),
    final_text="done",
    tool_calls=(
        ToolCall("read", '{"path": "a.py"}', True, id="call_0", turn=0),
        ToolCall("read", '{"path": "b.py"}', True, id="call_1", turn=0),
        ToolCall("lint", "{oops", False, "arguments are not JSON", id="call_2", turn=1),
    ),
    prompt_text="fix it",
    finish_reason="stop",
    link=Link("traj-1", 1, True, LinkReason.NOT_AN_EXTENSION),
)
