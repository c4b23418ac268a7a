"""Agent rollouts for the join benches: a trajectory of about N tokens (a prompt, then
turns that each call a tool and observe its result, over two policy versions) in the
record a worker writes for it, its bulk out of band past the inline limit (rtrl/bulk.py)."""

from __future__ import annotations

import functools
import uuid

from rtrl import bulk
from rtrl.trajectory import Link, LinkReason, Segment, ToolCall, Trajectory
from rtrl.v1 import common_pb2, rollout_pb2

INLINE_BYTES = 8 * 1024
"""The workers' default RTRL_INFERENCE_ROLLOUT_INLINE_BYTES."""
PROMPT, GENERATED, OBSERVED = 512, 48, 208
"""An agent's turn: a tool call of GENERATED tokens, then OBSERVED tokens of its result."""


@functools.cache
def trajectory(tokens: int) -> Trajectory:
    """A trajectory of about ``tokens`` tokens: a prompt, then turns that each call a tool
    and observe its result, over two policy versions."""
    turns = max(1, (tokens - PROMPT) // (GENERATED + OBSERVED))
    segments: list[Segment] = []
    for turn in range(turns):
        ids = [(7919 * (turn * GENERATED + i)) % 150_000 for i in range(GENERATED)]
        logprobs = [-0.01 * (i % 97) for i in range(GENERATED)]
        segments.append(Segment.generated(ids, logprobs, [7 + turn * 2 // turns] * GENERATED))
        if turn < turns - 1:
            segments.append(Segment.observed([(31 * i) % 150_000 for i in range(OBSERVED)], "tool"))
    return Trajectory(
        prompt_ids=tuple(range(1, PROMPT + 1)),
        segments=tuple(segments),
        final_text="Done: every file read.",
        tool_calls=tuple(
            ToolCall("read_file", f'{{"path": "f{t}.py"}}', True, id=f"call_{t}", turn=t)
            for t in range(turns)
        ),
        prompt_text="Read every file.",
        finish_reason="stop",
        link=Link("bench", 0, True, LinkReason.FIRST),
    )


def agent_rollout(tokens: int, rollout_id: str, ts_ms: int, inline: bool = False) -> bytes:
    """The rollout record of a ``tokens``-token trajectory as a worker writes it: out of
    band past the inline limit, unless ``inline`` (what would travel without rtrl/bulk.py)."""
    record = rollout_pb2.RolloutRecord(
        event_id=str(uuid.uuid4()),
        rollout_id=rollout_id,
        session_id="bench",
        client_ts_ms=ts_ms,
        model_name="bench-policy",
        arm=common_pb2.ARM_TREATMENT,
        latency_s=30.0,
    )
    trajectory(tokens).write(record)
    if not inline and record.ByteSize() > INLINE_BYTES:
        record, _ = bulk.split(record)
    return record.SerializeToString()
