"""Guarantee 8: `rtrl down` and `rtrl up` lose nothing but what the memory-only broker held.

`rtrl demo --minutes 1` (the real CLI and its default, agentic product, which ends with
`rtrl down`), then a plain `rtrl up` on the same state directory: it resumes the run the demo
left (its warm-started agent, eval suite and reward function), the treatment arm continues
from the version it stopped at,
every worker serves that version's weights bit for bit before the first new step, the
broker that went away is accounted for, and ClickHouse holds both runs with nothing
counted twice.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from rich.console import Console

from rtrl import signing
from rtrl.heartbeat import InferenceBeat
from rtrl.ops import broker_record, health, run_pin, stack_secrets
from rtrl.ops.lifecycle import down, up
from rtrl.ops.reporting import drain, query_function
from rtrl.ops.run_pin import RUN_SETTINGS
from rtrl.policy import weights_digest
from support import wait

# Both tests break the stack on purpose (a stop and a start; a FLUSHALL mid-run): guarantee 8.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.guarantee(8)]

TREATMENT = "treatment"


def _one(query, sql: str) -> int:
    return int(list(query(sql)[0].values())[0])


def _history(query) -> dict[str, int]:
    return {
        "rollouts": _one(query, "SELECT count() FROM rollouts FINAL"),
        "rewards": _one(query, "SELECT count() FROM rewards FINAL WHERE topic = 'rl.reward.v1'"),
        "steps": _one(query, "SELECT count() FROM trainer_steps FINAL"),
        "last_step": _one(query, "SELECT max(step) FROM trainer_steps"),
        "last_version": _one(query, "SELECT max(version) FROM trainer_steps WHERE published"),
    }


def _stored(client: redis.Redis, key: str | bytes) -> bytes:
    """The value at ``key``, which must exist (redis types a reply bytes | str | None)."""
    value = client.get(key)
    assert isinstance(value, bytes), f"{key!r}: {value!r}"
    return value


def _beats(stack) -> dict[str, Any]:
    return {row.name: row.beat for row in health.check(stack)}


@dataclass
class Resumed:
    stack: object
    state_dir: object
    first: dict[str, int]
    """The first run's history, read from its chdb after `rtrl demo` stopped it."""
    beats_at_start: dict[str, Any]
    """Every heartbeat right after `rtrl up`, before any traffic."""


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """`rtrl demo --minutes 1` (the real CLI, which ends with `rtrl down`) on a tiny agent
    put where the demo finds its warm start, then `rtrl up` on its state directory with
    nothing said of the run; the stack stays up for the module."""
    from support.trainer import install_tiny_agent_as_demo_agent

    tmp_path = tmp_path_factory.mktemp("restart")
    state_dir = tmp_path / "state"
    install_tiny_agent_as_demo_agent(state_dir)
    env = {**os.environ, "RTRL_STATE_DIR": str(state_dir), "RTRL_STACK_INFERENCE_WORKERS": "2"}
    env["RTRL_TRAINER_EVAL_TASKS"] = "16"  # the tiny agent's gate: a third of the demo's
    for name in RUN_SETTINGS:
        if name != "RTRL_TRAINER_EVAL_TASKS":
            env.pop(name, None)
    with open(tmp_path / "demo.log", "wb") as log:
        subprocess.run(
            [sys.executable, "-m", "rtrl", "demo", "--minutes", "1"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=True,
            timeout=900,
        )
    first = _history(query_function(None, state_dir))
    console = Console(file=io.StringIO())
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        for name in RUN_SETTINGS:  # what the demo set is the run's to restore
            if name not in env:
                patch.delenv(name, raising=False)
        stack = up(state_dir, console)
        try:
            yield Resumed(stack, state_dir, first, _beats(stack))
        finally:
            down(state_dir, console)


@pytest.mark.timeout(1500)
def test_a_stopped_stack_resumes_its_lineage_weights_and_history(resumed):
    from rtrl.ops.demo import run_product
    from rtrl.trainer.service import fetch_published

    stack, first, beats = resumed.stack, resumed.first, resumed.beats_at_start
    assert first["last_version"] >= 1, f"the first run published nothing: {first}"
    # `rtrl up`, told nothing, resumed the demo's run: its agent, reward function and settings.
    assert stack.reward_fn_version == "a2"
    run = run_pin.read(resumed.state_dir)
    assert run is not None and run.model_dir is not None and "/cache/warmstart-" in run.model_dir
    assert run.settings["RTRL_TRAINER_EVAL_SUITE"] == "rtrl.simulator.agent_suite:agent_suite"
    # Before any traffic: the lineage, the trainer and every worker are where the first run stopped.
    client = redis.Redis.from_url(stack.redis_url_as("operator"))
    assert int(_stored(client, f"rtrl:ws:{TREATMENT}:latest")) == first["last_version"]
    client.close()
    assert beats["trainer:0"].version == first["last_version"]
    assert beats["trainer:0"].step == first["last_step"]
    secrets = stack_secrets.load(resumed.state_dir)
    assert secrets is not None, "the stack has no secrets file"
    trainer_key = signing.public_key_of(secrets.manifest_signing_key)
    _, published = fetch_published(
        stack.weight_sync_addr,
        _subscribe_token(resumed.state_dir),
        TREATMENT,
        first["last_version"],
        [trainer_key],
    )
    workers = [key for key in beats if key.startswith("inference:")]
    assert len(workers) == 2
    for worker in workers:
        assert beats[worker].versions[TREATMENT] == first["last_version"]
        assert beats[worker].weights_digests[TREATMENT] == weights_digest(published), (
            f"{worker} serves other weights"
        )

    # The broker that went away: a new cluster, and what it held unjoined was measured after the services stopped.
    history = broker_record.read(resumed.state_dir)
    assert history.previous is not None and history.previous.final
    assert history.current is not None
    assert history.previous.cluster_id != history.current.cluster_id

    console = Console(file=io.StringIO())
    stats = run_product(stack, 40, console, agent=True, users=120, clients=16)
    drain(stack, stats, console, timeout_s=120)
    query = query_function(stack)
    second = _history(query)

    # The lineage continued: new steps and versions follow the first run's, none repeated.
    assert (
        second["last_version"] > first["last_version"] and second["last_step"] > first["last_step"]
    )
    assert (
        _one(
            query,
            f"SELECT min(version) FROM trainer_steps WHERE published AND step > {first['last_step']}",
        )
        == first["last_version"] + 1
    )
    assert _one(query, "SELECT count() FROM trainer_steps FINAL") == _one(
        query, "SELECT uniqExact(step) FROM trainer_steps"
    )
    # The report covers both runs, and nothing is counted twice.
    assert second["rollouts"] == first["rollouts"] + stats.completions
    assert _one(query, "SELECT uniqExact(rollout_id) FROM rollouts") == second["rollouts"]
    assert second["rewards"] == second["rollouts"]


@pytest.mark.timeout(900)
def test_flushall_mid_run_keeps_training_serving_and_versions_rising(resumed):
    """The stack's Redis loses everything while the product runs: weight_sync rebuilds the
    registry from the blob store, the trainer continues from the newest version there, the
    workers keep serving, and no version number goes back or is used twice."""
    from rtrl.ops.demo import run_product

    stack = resumed.stack
    client = redis.Redis.from_url(stack.redis_url_as("operator"))
    before = int(_stored(client, f"rtrl:ws:{TREATMENT}:latest"))
    seen: list[dict[str, int]] = []
    stop = threading.Event()

    def watch_workers() -> None:
        while not stop.wait(0.5):
            beats = _beats(stack)
            seen.extend(dict(b.versions) for b in beats.values() if isinstance(b, InferenceBeat))

    watcher = threading.Thread(target=watch_workers, daemon=True)
    watcher.start()
    flushed = threading.Timer(15, client.flushall)
    flushed.start()
    console = Console(file=io.StringIO())
    try:
        during = run_product(stack, 30, console, agent=True, users=120, clients=16)
        flushed.join()
        # The product's API key record went with the flush (keys are not rebuilt): the servers
        # kept their last verified copy (rtrl/api_keys.py KeyCache); a new run gets a new key.
        stats = run_product(stack, 30, console, agent=True, users=120, clients=16)
    finally:
        stop.set()
        watcher.join()
    # The workers answered every completion through the flush, with the key they had verified.
    assert during.completions > 0 and during.errors == 0, during.last_error
    assert stats.completions > 0 and stats.errors == 0 and stats.events_accepted > 0, (
        stats.last_error
    )
    after, beats = _trainer_caught_up(stack, client)
    client.close()
    assert beats["weight_sync:0"].registry_rebuilds >= 1
    assert after > before and beats["trainer:0"].version == after
    # Every worker answered throughout, never with a version older than before the flush.
    assert seen and min(v[TREATMENT] for v in seen) >= before
    versions = [int(m.version) for m in _manifests(stack, TREATMENT)]
    assert len(versions) == len(set(versions)) and max(versions) >= after


def _trainer_caught_up(stack, client, timeout_s: float = 60.0) -> tuple[int, dict[str, Any]]:
    """The registry's latest treatment version and the heartbeats, once the trainer's
    heartbeat shows that version (it publishes the last settled rewards after traffic stops)."""
    return wait.until(
        lambda: (int(client.get(f"rtrl:ws:{TREATMENT}:latest")), _beats(stack)),
        "the trainer's beat to show the registry's latest treatment version",
        ready=lambda seen: seen[1]["trainer:0"].version == seen[0],
        timeout_s=timeout_s,
        interval_s=1.0,
    )


def _manifests(stack, arm: str):
    from rtrl.v1 import weights_pb2

    client = redis.Redis.from_url(stack.redis_url_as("operator"))
    try:
        return [
            weights_pb2.Manifest.FromString(_stored(client, k))
            for k in client.scan_iter(f"rtrl:ws:{arm}:manifest:*")
        ]
    finally:
        client.close()


def _subscribe_token(state_dir) -> str:
    """The token the stack generated for its workers (ops/stack_secrets.py): there is no default."""
    secrets = stack_secrets.load(state_dir)
    assert secrets is not None, "the stack has no secrets file"
    return secrets.weight_sync_subscribe_token
