"""What a team asks of its agents, per policy version: trajectories and their links,
turns, tool calls per turn and the share that was broken, the share of turns that called
tools in parallel, the share of tokens the policy generated (the rest it observed), and
how many versions a trajectory spanned. From ``trajectory_links`` (one row per link)."""

from __future__ import annotations

from dataclasses import dataclass

from rtrl.analytics.query import QueryFn
from rtrl.analytics.schema import TRAJECTORY_LINKS


@dataclass(frozen=True)
class AgentsAtVersion:
    policy_version: int
    """The newest version that sampled any of a link's tokens."""
    arm: str
    trajectories: int
    links: int
    turns_per_trajectory: float
    tool_calls_per_turn: float
    invalid_share: float
    """Of the tool calls, those that were broken (unparseable, unknown tool...)."""
    parallel_share: float
    """Of the turns, those that called two tools or more."""
    generated_share: float
    """Of the tokens after the first prompt, those the policy generated."""
    versions_spanned: float
    """Mean versions that sampled one link's tokens."""


def agents_by_version(query_fn: QueryFn) -> list[AgentsAtVersion]:
    rows = query_fn(
        "SELECT policy_version_max AS version, arm, uniqExact(rollout_id) AS trajectories, "
        "count() AS links, sum(turns) AS turns, sum(tool_calls) AS calls, "
        "sum(invalid_tool_calls) AS invalid, sum(parallel_turns) AS parallel, "
        "sum(generated_tokens) AS generated, sum(observed_tokens) AS observed, "
        "avg(versions_spanned) AS spanned "
        f"FROM {TRAJECTORY_LINKS} FINAL GROUP BY version, arm ORDER BY version, arm"
    )
    return [
        AgentsAtVersion(
            policy_version=int(r["version"]),
            arm=str(r["arm"]),
            trajectories=int(r["trajectories"]),
            links=int(r["links"]),
            turns_per_trajectory=_ratio(r["turns"], r["trajectories"]),
            tool_calls_per_turn=_ratio(r["calls"], r["turns"]),
            invalid_share=_ratio(r["invalid"], r["calls"]),
            parallel_share=_ratio(r["parallel"], r["turns"]),
            generated_share=_ratio(r["generated"], int(r["generated"]) + int(r["observed"])),
            versions_spanned=float(r["spanned"]),
        )
        for r in rows
    ]


def _ratio(part: int, whole: int) -> float:
    return int(part) / int(whole) if int(whole) else 0.0
