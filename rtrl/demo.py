"""Driving the running stack with the simulated product, with a live view."""

from __future__ import annotations

import asyncio
import statistics
import time

import redis
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from rtrl import heartbeat
from rtrl.stack import StackFile
from simulator.product import Product, ProductStats


def _arm_table(stats: ProductStats, trainer: dict) -> Table:
    table = Table(title_justify="left", title=f"trainer step {trainer.get('step', '-')}, published v{trainer.get('version', '-')}")
    for column in ("arm", "completions", "persisted (last 400)", "dissatisfied (last 400)", "latency p50", "newest version"):
        table.add_column(column, justify="left" if column == "arm" else "right")
    for name, arm in stats.arms.items():
        persisted, dissatisfied = arm.recent_rates()
        p50 = statistics.median(arm.latency_s[-400:]) if arm.latency_s else float("nan")
        table.add_row(name, str(arm.completions), f"{persisted:.3f}", f"{dissatisfied:.3f}", f"{p50:.3f} s", str(arm.max_version))
    return table


def _trainer_status(client: redis.Redis) -> dict:
    for beat in heartbeat.read_all(client):
        if beat["service"] == "trainer":
            return beat
    return {}


async def _drive(product: Product, duration_s: float, console: Console, redis_url: str) -> ProductStats:
    progress = Progress(TextColumn("[bold]product[/] running"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"), TimeRemainingColumn())
    task = progress.add_task("run", total=duration_s)
    client = redis.Redis.from_url(redis_url)
    run = asyncio.create_task(product.run(duration_s))
    started = time.monotonic()
    with Live(console=console, refresh_per_second=2) as live:
        while not run.done():
            progress.update(task, completed=min(time.monotonic() - started, duration_s))
            stats = product.stats
            footer = f"events accepted {stats.events_accepted}, duplicate replies {stats.events_duplicate_replies}, errors {stats.errors}"
            if stats.last_error:
                footer += f"  (last: {stats.last_error[:80]})"
            live.update(Group(progress, _arm_table(stats, _trainer_status(client)), footer))
            await asyncio.sleep(0.5)
        progress.update(task, completed=duration_s)
        live.update(Group(progress, _arm_table(product.stats, _trainer_status(client))))
    client.close()
    return await run


def run_product(stack: StackFile, duration_s: float, console: Console, **product_options) -> ProductStats:
    product = Product(
        stack.urls("inference", "RTRL_INFERENCE_HTTP_PORT"),
        stack.urls("ingest", "RTRL_INGEST_HTTP_PORT")[0],
        **product_options,
    )
    return asyncio.run(_drive(product, duration_s, console, stack.redis_url))
