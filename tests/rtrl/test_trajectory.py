"""The trajectory (rtrl/trajectory.py): a flat rollout record read as its prompt and one
generated segment, its training targets, and what every other reader counts of it."""

from __future__ import annotations

from typing import Any

import pytest

from rtrl.trajectory import (
    MalformedTrajectory,
    Segment,
    SegmentKind,
    Summary,
    ToolCall,
    Trajectory,
    VersionSpan,
    targets,
)
from rtrl.v1 import rollout_pb2

PROMPT = [1, 40, 41]


def record(**fields: Any) -> rollout_pb2.RolloutRecord:
    """A single-turn record of three completion tokens sampled by version 4, overridden by
    ``fields``; ``spans`` is a list of (version, start, end)."""
    spans = fields.pop("spans", [(4, 0, 3)])
    base: dict[str, Any] = dict(
        prompt_text="@p0 say hi\n",
        prompt_token_ids=PROMPT,
        completion_token_ids=[50, 51, 2],
        completion_logprobs=[-0.5, -0.25, -0.125],
        completion_text="hi",
        finish_reason="stop",
        version_spans=[
            rollout_pb2.VersionSpan(policy_version=v, start=s, end=e) for v, s, e in spans
        ],
    )
    base.update(fields)
    return rollout_pb2.RolloutRecord(**base)


# Each case: the record's overrides, then what its trajectory holds: generated ids, their
# versions, whether it was truncated, and the training row (mask, log-probs, versions per
# target: target t is input t + 1).
READ_CASES = {
    # One generated segment after the prompt; the first completion token is target 2.
    "single_turn": (
        {},
        (50, 51, 2),
        (4, 4, 4),
        False,
        (0.0, 0.0, 1.0, 1.0, 1.0),
        (0.0, 0.0, -0.5, -0.25, -0.125),
        (-1, -1, 4, 4, 4),
    ),
    # A swap mid-rollout: every token keeps the version that sampled it.
    "versions_spanning_a_swap": (
        {"spans": [(4, 0, 2), (5, 2, 3)]},
        (50, 51, 2),
        (4, 4, 5),
        False,
        (0.0, 0.0, 1.0, 1.0, 1.0),
        (0.0, 0.0, -0.5, -0.25, -0.125),
        (-1, -1, 4, 4, 5),
    ),
    # Nothing generated: no segment, no target the loss counts.
    "empty_completion": (
        {"completion_token_ids": [], "completion_logprobs": [], "spans": [], "completion_text": ""},
        (),
        (),
        False,
        (0.0, 0.0),
        (0.0, 0.0),
        (-1, -1),
    ),
    # Stopped at max_tokens: read and trained as any other.
    "truncated": (
        {"finish_reason": "length"},
        (50, 51, 2),
        (4, 4, 4),
        True,
        (0.0, 0.0, 1.0, 1.0, 1.0),
        (0.0, 0.0, -0.5, -0.25, -0.125),
        (-1, -1, 4, 4, 4),
    ),
}


@pytest.mark.parametrize(
    "fields, generated, versions, truncated, mask, logprobs, target_versions",
    READ_CASES.values(),
    ids=READ_CASES.keys(),
)
def test_a_flat_record_reads_as_its_prompt_and_one_generated_segment(
    fields, generated, versions, truncated, mask, logprobs, target_versions
):
    rollout = record(**fields)
    trajectory = Trajectory.of(rollout)
    assert trajectory.prompt_ids == tuple(PROMPT)
    assert [s.kind for s in trajectory.segments] == [SegmentKind.GENERATED] * bool(generated)
    assert trajectory.generated_ids == generated and trajectory.generated_versions == versions
    assert trajectory.truncated is truncated
    assert trajectory.final_text == rollout.completion_text
    assert trajectory.tool_calls == ()
    row = targets(trajectory)
    assert row.input_ids == tuple(PROMPT) + generated and row.targets == len(row.input_ids) - 1
    assert (row.mask(), row.logprobs(), row.versions()) == (mask, logprobs, target_versions)
    # The lenient reading agrees with the strict one on every well-formed record.
    assert Summary.of(rollout) == trajectory.summary()


@pytest.mark.parametrize("fields", [c[0] for c in READ_CASES.values()], ids=READ_CASES.keys())
def test_writing_a_trajectory_gives_back_the_record_it_was_read_from(fields):
    rollout = record(**fields, tool_calls=[rollout_pb2.ToolCall(name="run", valid=False)])
    written = rollout_pb2.RolloutRecord()
    Trajectory.of(rollout).write(written)
    assert written.SerializeToString(deterministic=True) == rollout.SerializeToString(
        deterministic=True
    )


# Each case: overrides that make log-probs or versions not fit the tokens.
REFUSED_CASES = {
    # One log-prob short.
    "logprobs_short": {"completion_logprobs": [-0.5, -0.25]},
    # Spans covering two of three tokens.
    "spans_short": {"spans": [(4, 0, 2)]},
    # Spans covering four of three tokens.
    "spans_long": {"spans": [(4, 0, 2), (5, 2, 4)]},
    # Tokens with no span at all.
    "no_spans": {"spans": []},
    # As many tokens as spans cover, but token 0 is in none and token 1 in two.
    "spans_overlap": {"spans": [(4, 1, 2), (5, 1, 3)]},
    # A span that covers nothing.
    "empty_span": {"spans": [(3, 0, 0), (4, 0, 3)]},
    # A span reaching far past the tokens (refused before its versions are spelled out).
    "span_past_the_end": {"spans": [(4, 0, 2**32 - 1)]},
    # Spans out of order.
    "spans_unordered": {"spans": [(5, 2, 3), (4, 0, 2)]},
    # Spans naming versions of tokens that do not exist.
    "spans_without_tokens": {
        "completion_token_ids": [],
        "completion_logprobs": [],
        "spans": [(4, 0, 1)],
    },
}


@pytest.mark.parametrize("fields", REFUSED_CASES.values(), ids=REFUSED_CASES.keys())
def test_mismatched_lengths_are_refused(fields):
    with pytest.raises(MalformedTrajectory):
        Trajectory.of(record(**fields))


@pytest.mark.parametrize("fields", REFUSED_CASES.values(), ids=REFUSED_CASES.keys())
def test_the_summary_reads_any_record_as_it_is(fields):
    rollout = record(**fields)
    summary = Summary.of(rollout)
    assert summary.prompt_tokens == len(PROMPT)
    assert summary.generated_tokens == len(rollout.completion_token_ids)
    assert summary.final_text == "hi" and summary.finish_reason == "stop"


def test_generated_tokens_with_no_prompt_have_no_target():
    with pytest.raises(MalformedTrajectory):
        targets(Trajectory.of(record(prompt_token_ids=[])))


# Each case: a segment's fields; every one breaks a segment's invariant.
SEGMENT_CASES = {
    # A generated token without its log-prob.
    "generated_without_logprob": (SegmentKind.GENERATED, (5, 6), (-0.1,), (1, 1)),
    # A generated token without its version.
    "generated_without_version": (SegmentKind.GENERATED, (5, 6), (-0.1, -0.2), (1,)),
    # Observed tokens were never sampled: no log-probs.
    "observed_with_logprobs": (SegmentKind.OBSERVED, (5,), (-0.1,), ()),
    # Nor versions.
    "observed_with_versions": (SegmentKind.OBSERVED, (5,), (), (1,)),
}


@pytest.mark.parametrize("kind, ids, logprobs, versions", SEGMENT_CASES.values(), ids=SEGMENT_CASES)
def test_a_segment_refuses_fields_that_do_not_fit(kind, ids, logprobs, versions):
    with pytest.raises(MalformedTrajectory):
        Segment(kind, ids, logprobs, versions)


def test_observed_tokens_are_context_and_never_targets():
    """prompt [1, 2] | generated [3, 4] | observed [5] | generated [6]: the inputs are all
    six tokens, the targets the loss counts are 3, 4 (targets 1, 2) and 6 (target 4)."""
    trajectory = Trajectory(
        prompt_ids=(1, 2),
        segments=(
            Segment.generated((3, 4), (-0.3, -0.4), (7, 7)),
            Segment.observed((5,)),
            Segment.generated((6,), (-0.6,), (8,)),
        ),
    )
    row = targets(trajectory)
    assert row.input_ids == (1, 2, 3, 4, 5, 6)
    assert [(run.start, run.end) for run in row.runs] == [(1, 3), (4, 5)]
    assert row.mask() == (0.0, 1.0, 1.0, 0.0, 1.0)
    assert row.logprobs() == (0.0, -0.3, -0.4, 0.0, -0.6)
    assert row.versions() == (-1, 7, 7, -1, 8)
    assert trajectory.generated_ids == (3, 4, 6) and trajectory.oldest_version == 7
    assert trajectory.version_spans() == [VersionSpan(7, 0, 2), VersionSpan(8, 2, 3)]
    # Today's record holds one generated segment: it cannot carry this one.
    with pytest.raises(ValueError):
        trajectory.write(rollout_pb2.RolloutRecord())


def test_the_summary_counts_tokens_per_version_and_invalid_tool_calls():
    rollout = record(
        spans=[(4, 0, 1), (5, 1, 3)],
        tool_calls=[
            rollout_pb2.ToolCall(name="a", valid=True),
            rollout_pb2.ToolCall(name="b", arguments_json="{}", valid=False, error="no such file"),
        ],
    )
    summary = Summary.of(rollout)
    assert summary.version_tokens == ((4, 1), (5, 2))
    assert summary.version_range() == (4, 5) and summary.majority_version() == 5
    assert summary.invalid_tool_calls == 1
    assert summary.tool_calls[1] == ToolCall("b", "{}", False, "no such file")
    assert Summary.of(rollout_pb2.RolloutRecord()).version_range() is None
