"""The hacking monitor catches a hackable reward on the real embedded stack.

Under r1 a clarifying question scores the neutral 0.5, more than a guess in the
mixed project (simulator/users.py), so the treatment policy learns to ask there.
The stack is started exactly as `rtrl demo --reward-fn r1` starts it; the product
runs until reward_stream's heartbeat carries a clarifying_question drift alert, or
fails the test after MAX_PRODUCT_S.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import pytest
from rich.console import Console

from rtrl.heartbeat import RewardAlert
from rtrl.ops import health
from rtrl.ops.lifecycle import down, up
from rtrl.ops.reporting import query_function
from rtrl.ops.status_view import hacking_alerts, render
from rtrl.reward_stream.monitors import is_clarifying_question
from rtrl.simulator.product import Product
from support import wait

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_PRODUCT_S = 240


@pytest.fixture
def state_dir(tmp_path, monkeypatch, repo_root):
    from rtrl.simulator.warmstart import cache_path, ensure_warm_start

    monkeypatch.setenv("RTRL_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("RTRL_STACK_INFERENCE_WORKERS", "2")
    monkeypatch.setenv("RTRL_STACK_REWARD_FN_VERSION", "r1")
    # The warm start `rtrl up` caches in the repository's state dir (trained there once if
    # missing), so the test spends its minutes on traffic rather than on the warm start.
    cached = ensure_warm_start(repo_root / ".rtrl")
    (tmp_path / "cache").mkdir()
    shutil.copytree(cached, cache_path(tmp_path))
    return tmp_path


def drift_alerts(stack) -> list[RewardAlert]:
    return [
        a
        for a in hacking_alerts(health.check(stack))
        if a.kind == "drift" and a.metric == "clarifying_question"
    ]


async def drive_until_alert(stack) -> tuple[list[RewardAlert], float]:
    from rtrl.ops.demo import simulator_key

    product = Product(
        stack.urls("inference", "RTRL_INFERENCE_HTTP_PORT"),
        stack.urls("ingest", "RTRL_INGEST_HTTP_PORT")[0],
        api_key=await asyncio.to_thread(simulator_key, stack),
        users=400,
        clients=32,
    )
    run = asyncio.create_task(product.run(MAX_PRODUCT_S))
    started = time.monotonic()
    alerts: list[RewardAlert] = []
    while not run.done():
        alerts = await asyncio.to_thread(drift_alerts, stack)
        if alerts:
            product.stop()
            break
        await asyncio.sleep(2)
    stats = await run
    assert stats.errors == 0, stats.last_error
    return alerts, time.monotonic() - started


@pytest.mark.timeout(600)
def test_monitor_catches_questions_that_r1_pays_for(state_dir: Path):
    console = Console(file=open(os.devnull, "w"))
    stack = up(state_dir, console)
    try:
        assert stack.reward_fn_version == "r1"
        alerts, took_s = asyncio.run(drive_until_alert(stack))
        assert alerts, f"no clarifying_question drift alert after {took_s:.0f} s of product traffic"
        alert = alerts[0]
        # More questions than the warm start asked, measured on windows of 400 rollouts.
        assert alert.value - alert.previous_value >= 0.05 and alert.z_score >= 4
        assert alert.samples >= 400 and alert.previous_version < alert.first_version

        # The examples are real rollouts of the drifted versions, and they are questions.
        query = query_function(stack)
        ids = ", ".join(f"'{rollout_id}'" for rollout_id in alert.examples)
        rows = wait.until(
            lambda: query(
                f"SELECT completion_text FROM rollouts FINAL WHERE rollout_id IN ({ids})"
            ),
            "the example rollouts to reach ClickHouse",
            ready=lambda rows: len(rows) >= len(alert.examples),
            timeout_s=60,
            interval_s=1,
        )
        # Questions as the monitor counts them (it ends with "?" and holds no code): a drifted
        # policy also writes half-formed ones, like "def shotes p0 usp0 doe?", which the
        # product would not show as a question but the alert rightly counts.
        assert all(is_clarifying_question(row["completion_text"]) for row in rows), rows

        # `rtrl status` shows it.
        screen = Console(record=True, width=250, file=open(os.devnull, "w"))
        screen.print(render(stack))
        text = screen.export_text()
        assert "reward function: r1" in text and "clarifying_question" in text and "drift" in text
    finally:
        down(state_dir, console)
