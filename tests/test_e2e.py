"""The whole loop on the embedded stack, started exactly as `rtrl up` starts it.

Product events go in; rewards come out; the trainer publishes versions; every worker
applies them; ClickHouse holds exactly what was sent — nothing lost, nothing doubled —
and `rtrl down` leaves no process behind.
"""

from __future__ import annotations

import os

import pytest
import redis
from rich.console import Console

from rtrl import health
from rtrl.bench_loop import live_times
from rtrl.lifecycle import down, up
from rtrl.reporting import drain, query_function

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("RTRL_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("RTRL_STACK_INFERENCE_WORKERS", "2")
    return tmp_path


def _applied(redis_url: str) -> dict[int, dict[str, int]]:
    client = redis.Redis.from_url(redis_url)
    try:
        return {
            int(k.decode().rsplit(":", 1)[1]): {w.decode(): int(t) for w, t in client.hgetall(k).items()}
            for k in client.scan_iter("rtrl:applied:treatment:*")
        }
    finally:
        client.close()


@pytest.mark.timeout(900)
def test_loop_end_to_end(state_dir):
    from rtrl.demo import run_product

    console = Console(file=open(os.devnull, "w"))
    stack = up(state_dir, console)
    pids = [stack.supervisor_pid, *stack.infra.values(), *(s.pid for s in stack.services)]
    try:
        stats = run_product(stack, 45, console, users=120, clients=16)
        drain(stack, stats, console, timeout_s=120)
        query = query_function(stack)

        # Every stage saw traffic.
        assert stats.completions > 50 and stats.errors == 0, stats.last_error
        assert stats.events_duplicate_replies > 0, "the product's retries must reach the gateway as duplicates"
        beats = {row.name: row.status for row in health.check(stack)}
        assert beats["ingest:0"]["accepted"] > 0
        assert beats["reward_stream:0"]["settled"] > 0
        assert beats["trainer:0"]["step"] >= 2

        # `rtrl status` shows every component healthy, lag per group and topic, versions per worker.
        from rtrl.status_view import render

        screen = Console(record=True, width=200, file=open(os.devnull, "w"))
        screen.print(render(stack))
        text = screen.export_text()
        for spec in stack.services:
            assert spec.key in text
        assert "waiting" not in text
        for group in ("rtrl-reward-stream", "trainer", "analytics"):
            assert group in text
        assert "telemetry.rollout.v1" in text and "rl.reward.v1" in text

        # At least two new versions were published and went live on every worker.
        live = live_times(_applied(stack.redis_url))
        workers = {s.key for s in stack.services if s.name == "inference"}
        assert len([v for v in live if v > 0]) >= 2, live
        assert all(len(per_worker) == len(workers) for v, per_worker in _applied(stack.redis_url).items() if v in live)

        # ClickHouse holds exactly what was sent: nothing lost, nothing doubled.
        one = lambda sql: list(query(sql)[0].values())[0]  # noqa: E731
        rollouts = one("SELECT count() FROM rollouts FINAL")
        assert rollouts == stats.completions
        assert one("SELECT uniqExact(rollout_id) FROM rollouts") == stats.completions
        assert one("SELECT count() FROM telemetry_events FINAL") == stats.events_accepted
        assert one("SELECT count() FROM rewards FINAL WHERE topic = 'rl.reward.v1'") == rollouts
        assert one("SELECT uniqExact(rollout_id) FROM rewards WHERE topic = 'rl.reward.v1'") == rollouts
        # Privacy-mode users' events never reached a topic.
        assert stats.privacy_completions > 0 and stats.events_private > 0
        private = ", ".join(f"'{u}'" for u in stats.private_user_ids)
        assert one(f"SELECT count() FROM telemetry_events WHERE user_id IN ({private})") == 0
        assert one(f"SELECT count() FROM rollouts WHERE user_id IN ({private})") == 0

        # The stack's default reward (r3) pays nothing for asking instead of editing: no
        # drift towards clarifying questions (test_reward_hacking_live.py is the r1 side).
        from rtrl.status_view import hacking_alerts

        assert stack.reward_fn_version == "r3"
        assert not [a for a in hacking_alerts(health.check(stack)) if a["metric"] == "clarifying_question"]
    finally:
        down(state_dir, console)
    assert not [pid for pid in pids if health.pid_alive(pid)]
