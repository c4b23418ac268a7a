"""What a team asks of its agents, per policy version: trajectories and their links,
turns, tool calls per turn and the share that was broken, the share of turns that called
tools in parallel, the share of tokens the policy generated (the rest it observed), and
how many versions a trajectory spanned. From ``trajectory_links`` (one row per link)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from rtrl.analytics.query import QueryFn
from rtrl.analytics.schema import CLARIFYING_QUESTION, TRAJECTORY_LINKS


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
    tool_calls_per_trajectory: float = 0.0
    truncated_share: float = 0.0
    """Of the links, those whose generation ran out of tokens."""
    broken_share: float = 0.0
    """Of the links, those with a broken call (the rate a broken-call hack moves)."""
    question_share: float = 0.0
    """Of the trajectories, those whose final text is a clarifying question."""
    latency_p50_s: float | None = None
    """Median wall time of the trajectories (rollouts.wall_s)."""


def agents_by_version(query_fn: QueryFn, buckets: int | None = None) -> list[AgentsAtVersion]:
    """Per (version, arm): trajectory_links' counts, with the rollouts' questions and wall
    time at the same version. With ``buckets``, versions are pooled into at most that many
    runs of equal width, each named by its first version."""
    width = 1
    if buckets:
        (top,) = query_fn(f"SELECT max(policy_version_max) AS v FROM {TRAJECTORY_LINKS}")
        width = max(1, -(-(int(top["v"] or 0) + 1) // buckets))
    version = f"intDiv(policy_version_max, {width}) * {width}"
    outcomes = {
        (int(r["version"]), str(r["arm"])): r
        for r in query_fn(
            f"SELECT {version} AS version, arm, count() AS n, "
            f"countIf({CLARIFYING_QUESTION}) AS questions, "
            "quantileExactInclusive(0.5)(wall_s) AS latency_p50_s "
            f"FROM rollouts FINAL WHERE rollout_id IN (SELECT rollout_id FROM {TRAJECTORY_LINKS}) "
            "GROUP BY version, arm"
        )
    }
    rows = query_fn(
        f"SELECT {version} AS version, arm, uniqExact(rollout_id) AS trajectories, "
        "count() AS links, sum(turns) AS turns, sum(tool_calls) AS calls, "
        "sum(invalid_tool_calls) AS invalid, sum(parallel_turns) AS parallel, "
        "sum(generated_tokens) AS generated, sum(observed_tokens) AS observed, "
        "avg(versions_spanned) AS spanned, countIf(finish_reason = 'length') AS truncated, "
        "countIf(invalid_tool_calls > 0) AS broken_links "
        f"FROM {TRAJECTORY_LINKS} FINAL GROUP BY version, arm ORDER BY version, arm"
    )
    out = []
    for r in rows:
        outcome = outcomes.get((int(r["version"]), str(r["arm"])), {})
        out.append(
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
                tool_calls_per_trajectory=_ratio(r["calls"], r["trajectories"]),
                truncated_share=_ratio(r["truncated"], r["links"]),
                broken_share=_ratio(r["broken_links"], r["links"]),
                question_share=_ratio(outcome.get("questions", 0), outcome.get("n", 0)),
                latency_p50_s=_number(outcome.get("latency_p50_s")),
            )
        )
    return out


def _number(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]


AGENT_PANELS = (
    ("tool_calls_per_trajectory", "tool calls per trajectory"),
    ("broken_share", "trajectories with a broken call"),
    ("parallel_share", "parallel share of turns"),
    ("turns_per_trajectory", "turns per trajectory"),
    ("question_share", "clarifying questions"),
    ("latency_p50_s", "latency p50 (s)"),
)


def agents_png(rows: list[AgentsAtVersion]) -> bytes:
    """AGENT_PANELS against policy version, one line per arm."""
    import io

    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(14, 3.2), layout="constrained")
    for axes, (field, title) in zip(
        figure.subplots(1, len(AGENT_PANELS)), AGENT_PANELS, strict=True
    ):
        for arm, color in (("control", "tab:blue"), ("treatment", "tab:orange")):
            points = [
                (r.policy_version, getattr(r, field))
                for r in rows
                if r.arm == arm and getattr(r, field) is not None
            ]
            if points:
                axes.plot(
                    *zip(*points, strict=True), marker="o", markersize=3, color=color, label=arm
                )
        axes.set_title(title)
        axes.set_xlabel("policy version")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    figure.axes[0].legend(loc="best")
    out = io.BytesIO()
    figure.savefig(out, format="png", dpi=80)
    return out.getvalue()


_ROLLOUT_ID = re.compile(r"[A-Za-z0-9-]{1,64}")
"""What an example's id must be to be quoted into SQL (the joiner's ids are UUIDs)."""


def _ratio(part: int, whole: int) -> float:
    return int(part) / int(whole) if int(whole) else 0.0


@dataclass(frozen=True)
class Transcript:
    """An example trajectory, as an alert shows it: what was asked, what the policy called
    (each name once), and its final text."""

    rollout_id: str
    arm: str
    prompt: str
    turns: int
    tool_calls: int
    broken_calls: int
    tools: tuple[str, ...]
    final_text: str


def transcripts(query_fn: QueryFn, rollout_ids: Sequence[str]) -> list[Transcript]:
    """The final links of ``rollout_ids`` (ids outside [A-Za-z0-9-] are skipped), in order."""
    wanted = [r for r in rollout_ids if _ROLLOUT_ID.fullmatch(r)]
    if not wanted:
        return []
    listed = ", ".join(f"'{r}'" for r in wanted)
    rows = query_fn(
        "SELECT r.rollout_id AS rollout_id, r.arm AS arm, r.prompt_text AS prompt, "
        "r.completion_text AS final_text, r.tool_calls AS calls, "
        "r.invalid_tool_calls AS broken, l.turns AS turns, l.tool_names AS tools "
        f"FROM rollouts AS r FINAL LEFT JOIN {TRAJECTORY_LINKS} AS l FINAL "
        f"ON r.rollout_id = l.rollout_id WHERE r.rollout_id IN ({listed})"
    )
    by_id = {str(r["rollout_id"]): r for r in rows}
    return [
        Transcript(
            rollout_id=i,
            arm=str(by_id[i]["arm"]),
            prompt=str(by_id[i]["prompt"]),
            turns=int(by_id[i]["turns"] or 1),
            tool_calls=int(by_id[i]["calls"]),
            broken_calls=int(by_id[i]["broken"]),
            tools=tuple(by_id[i]["tools"] or ()),
            final_text=str(by_id[i]["final_text"]),
        )
        for i in wanted
        if i in by_id
    ]
