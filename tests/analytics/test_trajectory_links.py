"""Agents in ClickHouse: every link of an agent's chain is a row of trajectory_links (its
turns, tool calls by name and validity, parallel turns, generated against observed
tokens, versions spanned) beside its rollouts row, and `rtrl report` reads them per
policy version through the /query guard."""

from __future__ import annotations

import pytest

from rtrl import topics
from rtrl.analytics import schema
from rtrl.analytics.agents_report import agents_by_version, agents_png, transcripts
from rtrl.analytics.query import client_query_fn, connect, project_tables
from rtrl.analytics.sql_guard import checked_sql
from rtrl.config import StackSettings
from rtrl.trajectory import Link, LinkReason, Segment, ToolCall, Trajectory
from rtrl.v1 import common_pb2, rollout_pb2
from support import signed


def _link(rollout_id: str, position: int, final: bool, versions: tuple[int, int]) -> bytes:
    record = rollout_pb2.RolloutRecord(
        event_id=f"{rollout_id}-{position}",
        rollout_id=rollout_id,
        client_ts_ms=1_700_000_000_000 + position,
        arm=common_pb2.ARM_TREATMENT,
        model_name="tiny-agent",
    )
    calls = (
        ToolCall("read_file", '{"path": "a.py"}', True, id="c0", turn=0),
        ToolCall("read_file", '{"path": "b.py"}', True, id="c1", turn=0),
        ToolCall("search", "{", False, "the call is not JSON", id="c2", turn=1),
    )
    Trajectory(
        prompt_ids=(1, 2, 3),
        segments=(
            Segment.generated((4, 5), (-0.1, -0.2), (versions[0], versions[0])),
            Segment.observed((6, 7, 8), "tool"),
            Segment.generated(
                (9, 10, 11), (-0.1, -0.2, -0.3), (versions[0], versions[1], versions[1])
            ),
        ),
        final_text="done",
        tool_calls=calls,
        finish_reason="stop",
        link=Link(
            "t-1",
            position,
            final,
            LinkReason.FIRST if position == 0 else LinkReason.NOT_AN_EXTENSION,
        ),
    ).write(record)
    return record.SerializeToString()


def test_each_link_is_a_row_and_the_report_reads_them_per_version(tmp_path):
    client = connect(StackSettings(state_dir=tmp_path))
    schema.create_tables(client)
    sink = signed.checking_sink(client)
    links = [_link("r1", 0, False, (3, 4)), _link("r1", 1, True, (4, 4))]
    single = rollout_pb2.RolloutRecord(
        event_id="s", rollout_id="r2", client_ts_ms=1_700_000_000_000, prompt_token_ids=[1]
    ).SerializeToString()
    for offset, value in enumerate([*links, single, links[0]]):  # the first link replayed
        sink.add(signed.record(topics.ROLLOUT, 0, offset, b"r", value))
    sink.flush()

    rows = client.query(
        "SELECT link_position, final, link_reason, turns, tool_calls, invalid_tool_calls, "
        "parallel_turns, tool_names, tool_name_calls, tool_name_invalid, generated_tokens, "
        "observed_tokens, "
        "versions_spanned, policy_version_max FROM trajectory_links FINAL ORDER BY link_position"
    ).result_rows
    assert rows == [
        (
            0,
            False,
            "first",
            2,
            3,
            1,
            1,
            ["read_file", "search"],
            [2, 1],
            [0, 1],
            5,
            3,
            2,
            4,
        ),
        (
            1,
            True,
            "not_an_extension",
            2,
            3,
            1,
            1,
            ["read_file", "search"],
            [2, 1],
            [0, 1],
            5,
            3,
            1,
            4,
        ),
    ]
    # A single-turn rollout has no link: a rollouts row only.
    assert client.query("SELECT count() FROM rollouts FINAL").result_rows == [(2,)]

    tables = project_tables(client)

    def query(sql):
        return client_query_fn(client)(checked_sql(sql, tables))

    (at_v4,) = agents_by_version(query)
    assert (at_v4.policy_version, at_v4.arm, at_v4.trajectories, at_v4.links) == (
        4,
        "treatment",
        1,
        2,
    )
    assert at_v4.turns_per_trajectory == 4.0
    assert at_v4.tool_calls_per_turn == pytest.approx(1.5)
    assert at_v4.invalid_share == pytest.approx(1 / 3)
    assert at_v4.parallel_share == pytest.approx(0.5)
    assert at_v4.generated_share == pytest.approx(10 / 16)
    assert at_v4.versions_spanned == pytest.approx(1.5)
    assert (at_v4.tool_calls_per_trajectory, at_v4.truncated_share, at_v4.question_share) == (
        6.0,
        0.0,
        0.0,
    )
    assert at_v4.broken_share == 1.0  # each link made a broken call
    assert agents_png([at_v4]).startswith(b"\x89PNG")
    (pooled,) = agents_by_version(query, buckets=1)  # versions 0-4 in one bucket, named v0
    assert (pooled.policy_version, pooled.links, pooled.tool_calls_per_trajectory) == (0, 2, 6.0)
    (example,) = transcripts(query, ["r1", "x' OR 1=1 --"])  # an id that is no id is skipped
    assert (example.rollout_id, example.arm, example.turns, example.tool_calls) == (
        "r1",
        "treatment",
        2,
        3,
    )
    assert (example.broken_calls, example.tools, example.final_text) == (
        1,
        ("read_file", "search"),
        "done",
    )
