"""What is counted of a rollout: read from any record as it arrived, well-formed or not,
and from a record whose bulk is out of band (rtrl/bulk.py) by the counts it carries.

Produced for the reward functions, the reward-hacking monitors and the analytics sink's
rows, which store and count what arrived; what aligns tokens reads the strict
``Trajectory.of`` (rtrl/trajectory.py) instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rtrl.trajectory import Link, MalformedTrajectory, ToolCall, Trajectory, link_of, tool_calls_of
from rtrl.v1 import rollout_pb2


def _summary_link(record: rollout_pb2.RolloutRecord) -> Link | None:
    try:
        return link_of(record)
    except MalformedTrajectory:
        return None  # counted as it arrived: a link this version cannot read is no link


@dataclass(frozen=True)
class ToolCount:
    """The tool calls of one name in a rollout."""

    name: str
    calls: int
    invalid: int


def count_tools(calls: Sequence[ToolCall]) -> tuple[tuple[ToolCount, ...], int]:
    """(the calls per name, in the order first called; the turns that called two or more)."""
    per_name: dict[str, list[int]] = {}
    per_turn: dict[int, int] = {}
    for call in calls:
        counted = per_name.setdefault(call.name, [0, 0])
        counted[0] += 1
        counted[1] += not call.valid
        per_turn[call.turn] = per_turn.get(call.turn, 0) + 1
    counts = tuple(ToolCount(name, n, invalid) for name, (n, invalid) in per_name.items())
    return counts, sum(n >= 2 for n in per_turn.values())


# Produced by Summary.of (or Summary.of_trajectory); consumed by the reward functions,
# the reward-hacking monitors and the analytics sink's rows.
@dataclass(frozen=True)
class Summary:
    """What is counted of a rollout, read from any record (well-formed or not)."""

    prompt_tokens: int
    generated_tokens: int
    version_tokens: tuple[tuple[int, int], ...]
    """(version, generated tokens it sampled), each version once, in the order first seen;
    a record's version span that covers no token still names its version."""
    tool_calls: tuple[ToolCall, ...]
    """Every call as recorded; none for a record whose bulk is out of band, which carries
    tool_counts and parallel_turns instead."""
    final_text: str
    prompt_text: str
    finish_reason: str
    observed_tokens: int = 0
    """Tokens between the turns that the policy did not write (tool output, user messages)."""
    turns: int = 1
    """Assistant turns (generated runs): 1 for a single-turn completion, 0 for an empty one."""
    link: Link | None = None
    tool_counts: tuple[ToolCount, ...] = ()
    """The calls per name, in the order first called (count_tools)."""
    parallel_turns: int = 0
    """Turns that called two tools or more."""

    @classmethod
    def of(cls, record: rollout_pb2.RolloutRecord) -> Summary:
        if record.HasField("bulk"):
            return cls._of_bulk(record)
        counts: dict[int, int] = {}
        generated = observed = turns = 0
        runs = [s for s in record.segments if s.kind == rollout_pb2.Segment.KIND_GENERATED]
        for spans in [record.version_spans, *(s.version_spans for s in runs)]:
            for span in spans:
                version = int(span.policy_version)
                counts[version] = counts.get(version, 0) + int(span.end) - int(span.start)
        if record.segments:
            generated = sum(len(s.token_ids) for s in runs)
            observed = sum(len(s.token_ids) for s in record.segments) - generated
            turns = len(runs)
        else:
            generated = len(record.completion_token_ids)
            turns = 1 if generated else 0
        calls = tool_calls_of(record)
        tool_counts, parallel_turns = count_tools(calls)
        return cls(
            prompt_tokens=len(record.prompt_token_ids),
            generated_tokens=generated,
            version_tokens=tuple(counts.items()),
            tool_calls=calls,
            final_text=str(record.completion_text),
            prompt_text=str(record.prompt_text),
            finish_reason=str(record.finish_reason),
            observed_tokens=observed,
            turns=turns,
            link=_summary_link(record),
            tool_counts=tool_counts,
            parallel_turns=parallel_turns,
        )

    @classmethod
    def of_trajectory(cls, trajectory: Trajectory) -> Summary:
        """What Summary.of reads from the record ``trajectory`` writes."""
        counts: dict[int, int] = {}
        for version in trajectory.generated_versions:
            counts[version] = counts.get(version, 0) + 1
        tool_counts, parallel_turns = count_tools(trajectory.tool_calls)
        return cls(
            prompt_tokens=len(trajectory.prompt_ids),
            generated_tokens=len(trajectory.generated_ids),
            version_tokens=tuple(counts.items()),
            tool_calls=trajectory.tool_calls,
            final_text=trajectory.final_text,
            prompt_text=trajectory.prompt_text,
            finish_reason=trajectory.finish_reason,
            observed_tokens=trajectory.observed_tokens,
            turns=len(trajectory.generated),
            link=trajectory.link,
            tool_counts=tool_counts,
            parallel_turns=parallel_turns,
        )

    @classmethod
    def _of_bulk(cls, record: rollout_pb2.RolloutRecord) -> Summary:
        """A record whose bulk is out of band: the counts it carries."""
        bulk = record.bulk
        return cls(
            prompt_tokens=bulk.prompt_tokens,
            generated_tokens=bulk.generated_tokens,
            version_tokens=tuple((int(v.policy_version), v.tokens) for v in bulk.version_tokens),
            tool_calls=(),
            final_text=str(record.completion_text),
            prompt_text="",
            finish_reason=str(record.finish_reason),
            observed_tokens=bulk.observed_tokens,
            turns=bulk.turns,
            link=_summary_link(record),
            tool_counts=tuple(ToolCount(c.name, c.calls, c.invalid) for c in bulk.tool_calls),
            parallel_turns=bulk.parallel_turns,
        )

    @property
    def tool_call_count(self) -> int:
        return sum(count.calls for count in self.tool_counts)

    @property
    def invalid_tool_calls(self) -> int:
        return sum(count.invalid for count in self.tool_counts)

    def version_range(self) -> tuple[int, int] | None:
        """(oldest, newest) version that sampled the rollout; None when none is named."""
        versions = [version for version, _ in self.version_tokens]
        return (min(versions), max(versions)) if versions else None

    def majority_version(self) -> int | None:
        """The version that sampled most tokens (the newer one on a tie); None without one."""
        if not self.version_tokens:
            return None
        return max(self.version_tokens, key=lambda pair: (pair[1], pair[0]))[0]
