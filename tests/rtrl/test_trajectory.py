"""The trajectory (rtrl/trajectory.py): a flat rollout record read as its prompt and one
generated segment, an agent's record as its segments, tool calls by turn and link, their
training targets, and what every other reader counts of them."""

from __future__ import annotations

import re
from typing import Any

import pytest

from rtrl.trajectory import (
    MalformedTrajectory,
    Segment,
    SegmentKind,
    ToolCall,
    Trajectory,
    VersionSpan,
)
from rtrl.trajectory_summary import Summary
from rtrl.trajectory_targets import targets
from rtrl.v1 import rollout_pb2
from support.trajectories import AGENT

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
    assert Summary.of(rollout) == Summary.of_trajectory(trajectory)


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
            Segment.generated((3, 4), (-0.25, -0.5), (7, 7)),
            Segment.observed((5,)),
            Segment.generated((6,), (-0.625,), (8,)),
        ),
    )
    row = targets(trajectory)
    assert row.input_ids == (1, 2, 3, 4, 5, 6)
    assert [(run.start, run.end) for run in row.runs] == [(1, 3), (4, 5)]
    assert row.mask() == (0.0, 1.0, 1.0, 0.0, 1.0)
    assert row.logprobs() == (0.0, -0.25, -0.5, 0.0, -0.625)
    assert row.versions() == (-1, 7, 7, -1, 8)
    assert trajectory.generated_ids == (3, 4, 6) and trajectory.oldest_version == 7
    assert trajectory.version_spans() == [VersionSpan(7, 0, 2), VersionSpan(8, 2, 3)]
    # Written as segments, it reads back as it was.
    written = rollout_pb2.RolloutRecord()
    trajectory.write(written)
    assert Trajectory.of(written) == trajectory


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


# -- an agent's trajectory: segments, tool calls by turn, links ------------------------------


def agent_record() -> rollout_pb2.RolloutRecord:
    written = rollout_pb2.RolloutRecord(rollout_id="r-1")
    AGENT.write(written)
    return written


def test_an_agents_trajectory_round_trips_through_its_record():
    written = agent_record()
    assert [s.kind for s in written.segments] == [
        rollout_pb2.Segment.KIND_GENERATED,
        rollout_pb2.Segment.KIND_OBSERVED,
    ] * 2 + [rollout_pb2.Segment.KIND_GENERATED]
    # The flat completion is for a single turn only.
    assert not (written.completion_token_ids or written.completion_logprobs)
    assert not written.version_spans
    assert [(s.policy_version, s.start, s.end) for s in written.segments[4].version_spans] == [
        (8, 0, 1),
        (9, 1, 2),
    ]
    assert (written.link.trajectory_id, written.link.position, written.link.final) == (
        "traj-1",
        1,
        True,
    )
    # Through the wire and back: the same trajectory.
    again = rollout_pb2.RolloutRecord.FromString(written.SerializeToString())
    assert Trajectory.of(again) == AGENT
    summary = Summary.of(again)
    assert summary == Summary.of_trajectory(AGENT)
    assert (summary.turns, summary.generated_tokens, summary.observed_tokens) == (3, 5, 3)
    assert dict(summary.version_tokens) == {7: 2, 8: 2, 9: 1}
    assert summary.invalid_tool_calls == 1 and summary.link == AGENT.link


def test_an_agents_training_row_trains_on_what_the_policy_wrote_alone():
    row = targets(Trajectory.of(agent_record()))
    assert row.input_ids == (1, 2, 3, 4, 5, 6, 8, 9, 10, 11)
    assert row.mask() == (0, 1, 1, 0, 0, 1, 0, 1, 1)
    assert row.versions() == (-1, 7, 7, -1, -1, 8, -1, 8, 9)


def _broken(change) -> rollout_pb2.RolloutRecord:
    broken = agent_record()
    change(broken)
    return broken


# Each case: what breaks a well-formed agent record; Trajectory.of refuses it, saying so.
BROKEN_AGENT_CASES = {
    "logprobs_short": (lambda r: r.segments[0].logprobs.pop(), "segment 0: 1 log-probs"),
    "spans_short": (lambda r: r.segments[4].version_spans.pop(), "segment 4: version spans"),
    "observed_with_logprobs": (
        lambda r: r.segments[1].logprobs.append(-1.0),
        "observed segment 1 carries",
    ),
    "unknown_kind": (
        lambda r: setattr(r.segments[3], "kind", rollout_pb2.Segment.KIND_UNSPECIFIED),
        "segment 3 has no known kind",
    ),
    "also_flat": (lambda r: r.completion_token_ids.append(3), "also holds a flat completion"),
    "generated_with_a_source": (
        lambda r: setattr(r.segments[0], "source", "tool"),
        "a generated segment has no source",
    ),
    "link_without_reason": (
        lambda r: setattr(r.link, "reason", rollout_pb2.TrajectoryLink.REASON_UNSPECIFIED),
        "no known reason",
    ),
    "first_link_not_first": (lambda r: setattr(r.link, "position", 0), "link 0 of 'traj-1'"),
    "tool_call_of_no_turn": (lambda r: setattr(r.tool_calls[2], "turn", 3), "names turn 3 of 3"),
}


@pytest.mark.parametrize("change, says", BROKEN_AGENT_CASES.values(), ids=BROKEN_AGENT_CASES.keys())
def test_a_broken_agent_record_is_refused_and_still_counted(change, says):
    broken = _broken(change)
    with pytest.raises(MalformedTrajectory, match=re.escape(says)):
        Trajectory.of(broken)
    # The lenient reading counts what arrived (the reward and the analytics sink).
    assert Summary.of(broken).prompt_tokens == 2
