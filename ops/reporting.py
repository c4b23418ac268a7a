"""After a run: drain the pipeline into ClickHouse, then print the A/B table and write HTML."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from rtrl import topics
from rtrl.config import StackSettings
from rtrl.ops import stack_secrets
from rtrl.ops.stack import StackFile

if TYPE_CHECKING:
    from rtrl.analytics.training_report import MismatchSummary

LABELS = {
    "persisted_rate": "edits persisted",
    "dissatisfied_rate": "dissatisfied follow-ups",
    "latency_p50_s": "latency p50",
    "reward_mean": "reward mean",
    "rollouts": "rollouts",
    "rewards": "rewards",
}


def query_function(stack: StackFile | None, state_dir: Path | None = None):
    """Query the running sink over HTTP, or open the chdb tables directly when the stack is down."""
    from rtrl.analytics.query import client_query_fn, connect, http_query_fn

    if stack is not None:
        secrets = stack_secrets.load(Path(stack.state_dir))
        if secrets is None:
            raise RuntimeError(
                f"the stack in {stack.state_dir} has no {stack_secrets.SECRETS_FILE}: its query token is unknown"
            )
        return http_query_fn(
            stack.urls("analytics", "RTRL_ANALYTICS_QUERY_PORT")[0], secrets.analytics_query_token
        )
    return client_query_fn(
        connect(StackSettings(state_dir=state_dir) if state_dir else StackSettings())
    )


def landed(query) -> dict[str, int]:
    one = lambda sql: int(list(query(sql)[0].values())[0])
    return {
        "rollouts": one("SELECT count() FROM rollouts FINAL"),
        "events": one("SELECT count() FROM telemetry_events FINAL"),
        "rewards": one(f"SELECT count() FROM rewards FINAL WHERE topic = '{topics.REWARD}'"),
    }


def drain(stack: StackFile, stats, console: Console, timeout_s: float = 90.0) -> dict[str, int]:
    """Wait until every completion has a rollout row and a reward, and every accepted event a row."""
    query = query_function(stack)
    this_run = {
        "rollouts": stats.completions,
        "events": stats.events_accepted,
        "rewards": stats.completions,
    }
    expected = {name: stats.landed_before.get(name, 0) + n for name, n in this_run.items()}
    deadline = time.monotonic() + timeout_s
    with console.status("draining the pipeline into ClickHouse") as spinner:
        while True:
            counts = landed(query)
            spinner.update(f"draining: {counts} of {expected}")
            if counts == expected or time.monotonic() > deadline:
                break
            time.sleep(1)
    if counts != expected:
        console.print(
            f"[yellow]after {timeout_s:.0f} s ClickHouse holds {counts}, expected {expected}[/]"
        )
    else:
        console.print(f"drained: ClickHouse holds {counts}, exactly what was sent")
    return counts


def _fmt(metric: str, value: float | None) -> str:
    if value is None:
        return "–"
    if metric in ("rollouts", "rewards"):
        return str(int(value))
    if metric == "latency_p50_s":
        return f"{value * 1000:.0f} ms"
    return f"{value:.3f}"


def ab_rich_table(rows, window: str, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for column in ("metric", "control", "treatment", "change (abs)", "change (rel)"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for row in rows:
        if row.window != window:
            continue
        absolute = (
            ""
            if row.control is None or row.treatment is None or row.metric in ("rollouts", "rewards")
            else row.treatment - row.control
        )
        absolute = (
            f"{absolute * 1000:+.0f} ms"
            if row.metric == "latency_p50_s" and absolute != ""
            else (f"{absolute:+.3f}" if absolute != "" else "")
        )
        relative = "" if row.relative_change is None else f"{100 * row.relative_change:+.1f} %"
        table.add_row(
            LABELS.get(row.metric, row.metric),
            _fmt(row.metric, row.control),
            _fmt(row.metric, row.treatment),
            absolute,
            relative,
        )
    return table


def agents_table(rows: list) -> Table:
    """analytics.agents_report.agents_by_version as a table: an agent's trajectories per
    policy version."""
    table = Table(title="agents' trajectories by policy version (from the version shown)")
    for column in (
        "version", "arm", "trajectories", "turns", "calls", "with a broken call", "parallel turns",
        "questions", "latency p50", "versions spanned",
    ):  # fmt: skip
        table.add_column(column, justify="right")
    for r in rows:
        latency = "–" if r.latency_p50_s is None else f"{1000 * r.latency_p50_s:.0f} ms"
        table.add_row(
            f"v{r.policy_version}", r.arm, str(r.trajectories),
            f"{r.turns_per_trajectory:.2f}", f"{r.tool_calls_per_trajectory:.2f}",
            f"{100 * r.broken_share:.1f} %", f"{100 * r.parallel_share:.1f} %",
            f"{100 * r.question_share:.1f} %", latency, f"{r.versions_spanned:.2f}",
        )  # fmt: skip
    return table


def mismatch_line(summary: MismatchSummary | None) -> str:
    """The run's train–inference mismatch (analytics.training_report.MismatchSummary) in one line."""
    if summary is None:
        return (
            "train–inference mismatch: not measured (no step had tokens sampled by a "
            "version whose weights the trainer held)"
        )
    over = "/".join(f"{t:g}" for t in summary.thresholds)
    return (
        f"train–inference mismatch |Δ log p| (trainer vs sampler, each token under the "
        f"version that sampled it): "
        f"mean {summary.mean:.2e}, max {summary.max:.2e}, "
        f"{100 * summary.over_threshold_share:.2f} % over {over} nats; "
        f"{summary.tokens} tokens in {summary.measured_steps} of {summary.steps} steps"
    )


@dataclass(frozen=True)
class Report:
    """What `rtrl report` found, and where it wrote the HTML and JSON."""

    rows: list
    """The A/B rows (analytics.report.ABRow); empty when ClickHouse has no data yet."""
    agents: list = field(default_factory=list)
    """analytics.agents_report.AgentsAtVersion, pooled into at most 12 runs of versions."""
    mismatch: MismatchSummary | None = None
    html: Path | None = None
    ab_json: Path | None = None

    def as_json(self) -> dict:
        """`rtrl report --json`: the A/B tables (as reports/ab.json), the agents table, the
        train-inference mismatch, and the files written."""
        from rtrl.analytics.report import ab_json

        return {
            "ab": ab_json(self.rows),
            "agents": [asdict(row) for row in self.agents],
            "mismatch": asdict(self.mismatch) if self.mismatch else None,
            "html": str(self.html.resolve()) if self.html else None,
            "ab_json": str(self.ab_json.resolve()) if self.ab_json else None,
        }


def print_report(
    stack: StackFile | None,
    console: Console,
    html: Path = Path("reports/report.html"),
    state_dir: Path | None = None,
) -> Report:
    from rtrl.analytics.agents_report import agents_by_version
    from rtrl.analytics.report import ab_json, ab_table, by_version, write_html
    from rtrl.analytics.training_report import figures, mismatch_summary

    query = query_function(stack, state_dir)
    # A running stack's sink made its tables; a state directory no stack has run in has none.
    has_tables = stack is not None or int(list(query("EXISTS TABLE rollouts")[0].values())[0])
    rows = ab_table(query) if has_tables else []
    if not rows or all(r.control is None and r.treatment is None for r in rows):
        console.print("[yellow]no data in ClickHouse yet: run `rtrl demo` first[/]")
        return Report([])
    console.print(
        ab_rich_table(
            rows, "all", "A/B: control (frozen policy) vs treatment (real-time RL), whole run"
        )
    )
    console.print(ab_rich_table(rows, "last_half", "A/B, second half of the run"))
    mismatch = mismatch_summary(query)
    console.print(mismatch_line(mismatch))
    agents = agents_by_version(query, buckets=12)
    if agents:
        console.print(agents_table(agents))
    path = write_html(html, rows, by_version(query), extra_figures=figures(query).items)
    console.print(f"HTML report with plots against policy version: {path.resolve()}")
    tables = html.with_name("ab.json")
    tables.write_text(json.dumps(ab_json(rows), indent=1) + "\n")
    console.print(f"A/B tables as JSON: {tables.resolve()}")
    return Report(rows, agents, mismatch, path, tables)
