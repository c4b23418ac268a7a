"""A trajectory as one training row: ``targets`` says which next-token targets are
generated tokens, with the log-prob and the version that sampled each; the trainer's
collate and its mismatch probe both read it. Observed segments (tool output, a user's
message) are context: in the row, never a target."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from rtrl.trajectory import MalformedTrajectory, Segment, SegmentKind, Trajectory

_Value = TypeVar("_Value", int, float)


@dataclass(frozen=True)
class TargetRun:
    """Targets [start, end) of a row are one generated segment's tokens: the input at
    position start + i predicts the segment's token i."""

    start: int
    segment: Segment

    @property
    def end(self) -> int:
        return self.start + len(self.segment.token_ids)


# Produced by targets; consumed by the trainer's collate (mask, log-probs) and its
# mismatch probe (versions).
@dataclass(frozen=True)
class TargetAlignment:
    """A trajectory as one training row. ``input_ids`` is the prompt and every segment's
    tokens; target t is input_ids[t + 1], predicted from position t, so a row of L inputs
    has L - 1 targets. The loss counts the targets in ``runs`` (generated tokens) alone."""

    input_ids: tuple[int, ...]
    runs: tuple[TargetRun, ...]

    @property
    def targets(self) -> int:
        return len(self.input_ids) - 1

    def mask(self) -> tuple[float, ...]:
        """1.0 where the target is a generated token, else 0.0."""
        return self._per_target(0.0, lambda run: (1.0,) * len(run.segment.token_ids))

    def logprobs(self) -> tuple[float, ...]:
        """The sampling log-prob of each generated target, 0.0 elsewhere."""
        return self._per_target(0.0, lambda run: run.segment.logprobs)

    def versions(self) -> tuple[int, ...]:
        """The version that sampled each generated target, -1 elsewhere."""
        return self._per_target(-1, lambda run: run.segment.versions)

    def _per_target(
        self, fill: _Value, values: Callable[[TargetRun], tuple[_Value, ...]]
    ) -> tuple[_Value, ...]:
        row = [fill] * self.targets
        for run in self.runs:
            row[run.start : run.end] = values(run)
        return tuple(row)


def targets(trajectory: Trajectory) -> TargetAlignment:
    """The trajectory's training row. Raises MalformedTrajectory when a generated token
    has nothing before it (an empty prompt): no position predicts it."""
    input_ids: list[int] = list(trajectory.prompt_ids)
    runs: list[TargetRun] = []
    for segment in trajectory.segments:
        if segment.kind is SegmentKind.GENERATED and segment.token_ids:
            if not input_ids:
                raise MalformedTrajectory("generated tokens with no prompt before them")
            runs.append(TargetRun(len(input_ids) - 1, segment))
        input_ids.extend(segment.token_ids)
    return TargetAlignment(tuple(input_ids), tuple(runs))
