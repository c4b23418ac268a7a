"""Driving the running stack with the simulated product, with a live view."""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import redis
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from rtrl import heartbeat
from rtrl.key_budgets import Budgets
from rtrl.ops import health, run_pin, stack_secrets, statedir
from rtrl.ops.reporting import landed, query_function
from rtrl.ops.stack import StackFile
from rtrl.ops.status_view import alerts_table, hacking_alerts
from rtrl.reward_stream.monitors import DRIFT
from rtrl.reward_stream.reward import AGENT_REWARD_FN_VERSION
from rtrl.simulator.agent_product import AgentArmStats, AgentProduct
from rtrl.simulator.product import DEFAULT_CLIENTS, Product, ProductStats


def _arm_table(stats: ProductStats, trainer: heartbeat.Beat | None) -> Table:
    title = (
        f"trainer step {trainer.step}, published v{trainer.version}"
        if isinstance(trainer, heartbeat.TrainerBeat)
        else "trainer starting"
    )
    table = Table(title_justify="left", title=title)
    agent = all(isinstance(arm, AgentArmStats) for arm in stats.arms.values())
    columns = [
        "arm",
        "completions" if not agent else "trajectories",
        "persisted (last 400)",
        "dissatisfied (last 400)",
        "questions (last 400)",
        "latency p50",
        "newest version",
    ]
    if agent:
        columns[6:6] = ["tool calls (last 400)", "turns (last 400)"]
    for column in columns:
        table.add_column(column, justify="left" if column == "arm" else "right")
    for name, arm in stats.arms.items():
        persisted, dissatisfied, asked = arm.recent_rates()
        p50 = statistics.median(arm.latency_s[-400:]) if arm.latency_s else float("nan")
        cells = [
            name,
            str(arm.completions),
            f"{persisted:.3f}",
            f"{dissatisfied:.3f}",
            f"{asked:.3f}",
            f"{p50:.3f} s",
            str(arm.max_version),
        ]
        if isinstance(arm, AgentArmStats):
            cells[6:6] = [_recent_mean(arm.tool_calls), _recent_mean(arm.turns)]
        table.add_row(*cells)
    return table


def _recent_mean(values: list[int]) -> str:
    return f"{statistics.mean(values[-400:]):.2f}" if values else "–"


def _statuses(client: redis.Redis) -> dict[str, heartbeat.Beat]:
    """The newest heartbeat of each service (the first instance's)."""
    beats: dict[str, heartbeat.Beat] = {}
    for beat in heartbeat.read(client):
        beats.setdefault(beat.service, beat.beat)
    return beats


def _footer(stats: ProductStats, beats: dict[str, heartbeat.Beat]) -> str:
    footer = (
        f"events accepted {stats.events_accepted}, "
        f"duplicate replies {stats.events_duplicate_replies}, errors {stats.errors}"
    )
    joiner = beats.get("reward_stream")
    alerts = (
        [a for a in joiner.alerts if a.metric in DRIFT]
        if isinstance(joiner, heartbeat.RewardStreamBeat)
        else []
    )
    if alerts:
        newest = alerts[-1]
        footer += (
            f"\n[bold red]reward-hacking alerts: {len(alerts)}[/], "
            f"newest: {newest.metric} {newest.previous_value:.3f} -> {newest.value:.3f}"
        )
    if stats.last_error:
        footer += f"  (last: {stats.last_error[:80]})"
    return footer


async def _drive(
    product: Product, duration_s: float, console: Console, redis_url: str
) -> ProductStats:
    progress = Progress(
        TextColumn("[bold]product[/] running"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TimeRemainingColumn(),
    )
    task = progress.add_task("run", total=duration_s)
    client = redis.Redis.from_url(redis_url)
    run = asyncio.create_task(product.run(duration_s))
    started = time.monotonic()

    def view() -> Group:
        beats = _statuses(client)
        table = _arm_table(product.stats, beats.get("trainer"))
        return Group(progress, table, _footer(product.stats, beats))

    with Live(console=console, refresh_per_second=2) as live:
        while not run.done():
            progress.update(task, completed=min(time.monotonic() - started, duration_s))
            live.update(view())
            await asyncio.sleep(0.5)
        progress.update(task, completed=duration_s)
        live.update(view())
    client.close()
    return await run


UNIQUE_PROMPTS_TRAINER: dict[str, str] = {
    "RTRL_TRAINER_BASELINE": "context",
    "RTRL_TRAINER_INITIAL_POLICY": "rtrl.simulator.warmstart:unique_prompt_policy",
    "RTRL_TRAINER_EVAL_SUITE": "rtrl.simulator.suite:unique_prompt_suite",
}
"""The trainer's settings for ``rtrl demo --unique-prompts`` wherever the environment sets none:
no two rollouts share a prompt, so leave-one-out has no group to compare within and the
context baseline (trainer/baseline.py) takes over; the policy and its eval suite know serials."""


def unique_prompts_env(environ: Mapping[str, str]) -> dict[str, str]:
    """UNIQUE_PROMPTS_TRAINER with whatever ``environ`` sets instead."""
    return {name: environ.get(name, value) for name, value in UNIQUE_PROMPTS_TRAINER.items()}


def prepare_unique_prompts(state_dir: Path, console: Console) -> None:
    """Set the trainer's unique-prompts settings for the stack about to start, and warm-start
    its policy here (cached), so the trainer does not spend its health timeout on it."""
    from rtrl.simulator.warmstart import WarmStartRecipe, ensure_warm_start
    from rtrl.trainer.config import TrainerSettings

    os.environ.update(unique_prompts_env(os.environ))
    if not statedir.is_state_dir(state_dir) and statedir.foreign_entries(state_dir):
        return  # not a directory rtrl may write to: `rtrl up` says why
    recipe = WarmStartRecipe(seed=TrainerSettings().seed, unique_prompts=True)
    with console.status("warm start of the unique-prompts policy (cached after the first run)"):
        path = ensure_warm_start(state_dir.resolve(), recipe=recipe)
    console.print(f"unique prompts: warm start {path.name}, trainer baseline context")


def simulator_budgets(clients: int) -> Budgets:
    """The budgets of the simulated product's one key. It stands for ``clients`` editors that
    ask again the moment an answer comes back (nobody types in between), so one editor's
    budgets (ONE_CLIENT) would throttle it: it may have as many completions in flight as it
    has editors, and 100 requests a second per editor, each edit being one completion and
    two or three events. The demo's completions take a few hundred milliseconds, so that is
    over ten times what an editor asks for: the product is never refused, and a bug that
    floods the servers from it still is."""
    return Budgets(rate_per_s=100.0 * clients, burst=100.0 * clients, max_concurrency=clients)


def simulator_key(stack: StackFile, clients: int = DEFAULT_CLIENTS) -> str:
    """An API key for a simulated product of ``clients`` editors, for telemetry and
    completions (a new one per run; keys are cheap), signed with the stack's operator key."""
    from rtrl.api_keys import ALL_EVENTS, COMPLETIONS, call_sync, issue_key

    authority = stack_secrets.key_authority(Path(stack.state_dir))
    return call_sync(
        stack.redis_url_as("operator"), issue_key, authority, "simulated-product",
        scopes={ALL_EVENTS, COMPLETIONS}, **simulator_budgets(clients).issue_args(),
    )  # fmt: skip


AGENT_TRAINER: dict[str, str] = {
    "RTRL_TRAINER_BASELINE": "context",
    "RTRL_TRAINER_EVAL_SUITE": "rtrl.simulator.agent_suite:agent_suite",
    "RTRL_TRAINER_EVAL_TASKS": "48",
    "RTRL_TRAINER_STEPS_PER_CANDIDATE": "3",
}
"""The trainer's settings for the agentic demo wherever the environment sets none: its
prompts are unique, so the context baseline, one running mean as the product sends no
context_key (simulator/agent_product.py says why); its eval suite plays held-out tasks as the
agent (simulator/agent_suite.py). Playing 128 trajectories
took the gate 4-6 s a candidate against 1 s of training, so the gate plays 48 and a candidate
takes three optimizer steps: about three times the steps in the demo's minutes."""


def prepare_agent(state_dir: Path, console: Console) -> Path:
    """Set the agentic demo's trainer settings and reward (a2 unless one is set) for the stack
    about to start, and warm-start its policy here (cached): the model directory to serve."""
    from rtrl.ops.lifecycle import warm_start
    from rtrl.simulator.agent_warmstart import AGENT_POLICY, AgentRecipe
    from rtrl.trainer.config import TrainerSettings

    os.environ.update({k: os.environ.get(k, v) for k, v in AGENT_TRAINER.items()})
    os.environ.setdefault("RTRL_STACK_REWARD_FN_VERSION", AGENT_REWARD_FN_VERSION)
    recipe = AgentRecipe(seed=TrainerSettings().seed)
    return warm_start(state_dir.resolve(), console, policy_config=AGENT_POLICY, recipe=recipe)


WARM_START_S = {"agent": 275.0, "edits": 60.0}
"""How long each product's warm start trains on 2 cores, the first time (cached after in
the state directory): measured by `make demo` (docs/benchmarks.md)."""
STACK_START_S = 30.0
DRAIN_AND_REPORT_S = 60.0


def print_plan(console: Console, product: str, minutes: float, warm_cached: bool) -> None:
    """Each phase of the demo with its expected duration on 2 cores, before any of them starts."""
    warm_s = 0.0 if warm_cached else WARM_START_S[product]
    phases = [
        ("warm start", "cached" if warm_cached else f"~{warm_s / 60:.0f} min, once", "steps, loss"),
        ("the embedded stack", f"~{STACK_START_S:.0f} s", "each component's health"),
        ("the simulated product", f"{minutes:g} min", "the A/B as it runs"),
        ("drain, A/B report", f"~{DRAIN_AND_REPORT_S / 60:.0f} min", "the A/B table, alerts"),
    ]
    total_min = (warm_s + STACK_START_S + minutes * 60 + DRAIN_AND_REPORT_S) / 60
    table = Table(
        title=f"rtrl demo --product {product}: about {total_min:.0f} min on 2 cores",
        title_justify="left",
    )
    for column in ("phase", "expected", "shows"):
        table.add_column(column, justify="right" if column == "expected" else "left")
    for row in phases:
        table.add_row(*row)
    console.print(table)


def warm_start_cached(state_dir: Path, product: str, unique_prompts: bool) -> bool:
    """Whether the demo's warm start is already in ``state_dir``'s cache."""
    from rtrl.simulator.agent_warmstart import AGENT_POLICY, AgentRecipe
    from rtrl.simulator.warmstart import WarmStartRecipe, cache_path
    from rtrl.trainer.config import TrainerSettings

    seed = TrainerSettings().seed
    if product == "agent":
        return cache_path(state_dir, AGENT_POLICY, AgentRecipe(seed=seed)).exists()
    recipe = WarmStartRecipe(seed=seed, unique_prompts=unique_prompts)
    return cache_path(state_dir, recipe=recipe).exists()


def run_demo(
    state_dir: Path,
    console: Console,
    *,
    product: str,
    minutes: float,
    keep_running: bool,
    reward_fn: str | None,
    unique_prompts: bool,
    fresh: bool,
) -> int:
    """``rtrl demo``: the stack up, the product run, the A/B table and the reward-hacking
    alerts; the exit code (1 when the stack did not start)."""
    from rtrl.ops.lifecycle import StackError
    from rtrl.ops.lifecycle import down as stop
    from rtrl.ops.lifecycle import up as start
    from rtrl.ops.reporting import drain, print_report
    from rtrl.ops.stack import StackConfig

    if reward_fn is not None:
        os.environ["RTRL_STACK_REWARD_FN_VERSION"] = reward_fn
    agent = product == "agent"
    print_plan(console, product, minutes, warm_start_cached(state_dir, product, unique_prompts))
    foreign = not statedir.is_state_dir(state_dir) and statedir.foreign_entries(state_dir)
    # Nothing is written into a directory rtrl may not take: `rtrl up` says why below.
    model_dir = prepare_agent(state_dir, console) if agent and not foreign else None
    console.print(f"product: {product}, reward function: {StackConfig().reward_fn_version}")
    if unique_prompts and not agent:
        prepare_unique_prompts(state_dir, console)
    resumed = run_pin.read(state_dir) if not (fresh or unique_prompts or agent) else None
    if resumed is not None and resumed.model_dir is not None:
        console.print(
            f"[red]the run in {state_dir} trains {resumed.describe()}, not the demo policy:[/] "
            "`rtrl up` resumes it; `rtrl demo --product edits --fresh` starts this demo over"
        )
        return 1
    try:
        stack = start(
            state_dir, console, fresh=fresh or unique_prompts or agent, model_dir=model_dir
        )
    except StackError as exc:
        console.print(f"[red]{exc}[/]")
        return 1
    try:
        options: dict[str, Any] = {"unique_prompts": unique_prompts}
        stats = run_product(stack, minutes * 60, console, agent=agent, **options)
        drain(stack, stats, console)
        print_report(stack, console)
        print_hacking_report(stack, stats, console)
    finally:
        if not keep_running:
            stop(state_dir, console)
    return 0


def run_product(
    stack: StackFile, duration_s: float, console: Console, *, agent: bool = False, **product_options
) -> ProductStats:
    clients = product_options.setdefault("clients", DEFAULT_CLIENTS)
    if agent:
        product_options.pop("unique_prompts", None)
    product = (AgentProduct if agent else Product)(
        stack.urls("inference", "RTRL_INFERENCE_HTTP_PORT"),
        stack.urls("ingest", "RTRL_INGEST_HTTP_PORT")[0],
        api_key=simulator_key(stack, clients),
        **product_options,
    )
    product.stats.landed_before = landed(query_function(stack))
    return asyncio.run(_drive(product, duration_s, console, stack.redis_url_as("operator")))


def question_rate_table(stats: ProductStats, bucket_s: float = 30.0) -> Table:
    table = Table(
        title=f"clarifying questions asked, per {bucket_s:.0f} s of the run", title_justify="left"
    )
    table.add_column("from")
    rates = {
        name: {start: (n, rate) for start, n, rate in arm.question_rates(bucket_s)}
        for name, arm in stats.arms.items()
    }
    for name in rates:
        table.add_column(name, justify="right")
    for start in sorted({start for per_arm in rates.values() for start in per_arm}):
        cells = [
            f"{per_arm[start][1]:.3f} of {per_arm[start][0]}" if start in per_arm else "–"
            for per_arm in rates.values()
        ]
        table.add_row(f"{start:.0f} s", *cells)
    return table


def print_hacking_report(
    stack: StackFile, stats: ProductStats, console: Console
) -> list[heartbeat.RewardAlert]:
    """The question rate over the run and the reward-hacking alerts reward_stream raised;
    returns those alerts. Read from the heartbeat, so the stack must still be up."""
    alerts = [a for a in hacking_alerts(health.check(stack)) if a.metric in DRIFT]
    console.print(question_rate_table(stats))
    title = f"reward function {stack.reward_fn_version or '?'}"
    if not alerts:
        console.print(f"{title}: no reward-hacking alerts")
        return alerts
    console.print(f"[bold red]{title}: {len(alerts)} reward-hacking alert(s)[/]")
    console.print(alerts_table(alerts, examples=3))
    console.print(example_trajectories(stack, alerts))
    return alerts


def example_trajectories(stack: StackFile, alerts: list[heartbeat.RewardAlert]) -> Table:
    """The newest alert's example rollouts of each metric, as trajectories from ClickHouse."""
    from rtrl.analytics.agents_report import transcripts

    newest = {alert.metric: alert for alert in alerts}
    table = Table(title="example trajectories of the alerts", title_justify="left")
    for column in ("metric", "rollout", "prompt", "turns", "calls (broken)", "tools", "final text"):
        table.add_column(column, overflow="fold")
    query = query_function(stack)
    for metric, alert in newest.items():
        for t in transcripts(query, alert.examples[:3]):
            table.add_row(
                metric,
                t.rollout_id[:8],
                t.prompt.strip(),
                str(t.turns),
                f"{t.tool_calls} ({t.broken_calls})",
                " ".join(t.tools),
                t.final_text.strip()[:80],
            )
    return table
