"""`rtrl bench serving-abuse`: what one default key can do to another client of the same
worker (the H1 and M1 attacks of docs/security.md, at full size).

One worker serves the demo policy on a scratch stack (Tansu, redis-server), its keys
issued with `rtrl keys create`'s default budgets (rtrl/key_budgets.py ONE_CLIENT: 20
requests/s, 4 in flight). A neighbour client plays a well-behaved agent: it opens a
trajectory, continues it, ends it (three requests, each timed).

* ``quiet``: the neighbour's request latencies with nobody else on the worker, after a
  few uncounted agents that warm the worker up.
* ``h1``: the attacker sends ``over_context`` first turns past the context (each 400)
  and ``dropped`` streamed turns it drops after their first token, as fast as its budget
  lets it; then the neighbour plays its agent: every request must succeed, and the
  worker must hold no trajectory but the neighbour's.
* ``m1``: the attacker drops streams at ``drop_rate_per_s`` while the neighbour plays
  ``probes`` agents; ``p99_ratio`` = the neighbour's p99 then / its quiet p99 (at most 2
  is the bar), ``most_running``: the most generations the engine ran at once
  (the attacker's budget plus the neighbour's one at most).

Latencies are reported, never asserted: a shared machine's times vary.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console

from rtrl.bench.stack import scratch_stack

OVER_CONTEXT = "x" * 200
"""A first turn past the demo policy's 128 positions."""
AGENT_PACE_S = 0.3
"""The neighbour's pause after each agent (3 requests): 10 requests/s at most, half its
default rate, so its own budget never refuses it."""


def run(
    out: Path,
    console: Console,
    *,
    over_context: int = 2_000,
    dropped: int = 500,
    drop_rate_per_s: float = 20.0,
    probes: int = 100,
) -> dict[str, Any]:
    from rtrl import signing
    from rtrl.inference.config import InferenceSettings

    operator_key = signing.generate_private_key()
    settings = InferenceSettings(
        http_port=0,
        follow_weights=False,
        rollout_signing_key=signing.generate_private_key(),
        rollout_mac_key=signing.generate_mac_key(),
    )
    with (
        tempfile.TemporaryDirectory(prefix="rtrl-bench-abuse-") as tmp,
        scratch_stack(Path(tmp), api_key_public_keys=signing.public_key_of(operator_key)) as stack,
    ):
        results = asyncio.run(
            _scenario(stack, settings, operator_key, console, over_context, dropped,
                      drop_rate_per_s, probes)
        )  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    console.print_json(json.dumps(results))
    return results


async def _scenario(
    stack: Any,
    settings: Any,
    operator_key: str,
    console: Console,
    over_context: int,
    dropped: int,
    drop_rate_per_s: float,
    probes: int,
) -> dict[str, Any]:
    server, attacker, neighbour = await _worker(stack, settings, operator_key)
    base = f"http://127.0.0.1:{server.port}/v1/trajectories"
    try:
        async with aiohttp.ClientSession() as http:
            agent, attack = _Agent(http, base, neighbour), _Attacker(http, base, attacker)
            warm = max(5, probes // 5)
            console.print(f"warm-up: {warm} agents of the neighbour (not counted)")
            for i in range(warm):  # first requests pay for compiling and caching: not the quiet p99
                await agent.play(f"warm-{i}")
            console.print(f"quiet: {probes} agents of the neighbour")
            quiet = [await agent.play(f"quiet-{i}") for i in range(probes)]
            console.print(f"h1: {over_context} over-context turns, {dropped} dropped streams")
            started = time.monotonic()
            refused = [await attack.over_context(f"long-{i}") for i in range(over_context)]
            drops = [await attack.drop(f"drop-{i}") for i in range(dropped)]
            attack_s = time.monotonic() - started
            after = await agent.play("after-h1")
            open_after = len(server.api.sessions)
            console.print(f"m1: streams dropped at {drop_rate_per_s:g}/s beside {probes} agents")
            most = _MostRunning(server.engine)
            flood = asyncio.ensure_future(attack.drop_at(drop_rate_per_s))
            loaded = [await agent.play(f"loaded-{i}") for i in range(probes)]
            flood.cancel()
            await asyncio.gather(flood, return_exceptions=True)
            most.stop()
    finally:
        await server.stop()
    quiet_lat = [s for run in quiet for s in run[1]]
    loaded_lat = [s for run in loaded for s in run[1]]
    return {
        "quiet": _summary(quiet_lat) | {"statuses": _counts([s for r in quiet for s in r[0]])},
        "h1": {
            "over_context_statuses": _counts(refused),
            "dropped_statuses": _counts(drops),
            "attack_s": round(attack_s, 1),
            "neighbour_after": {"statuses": after[0], "latency_s": after[1]},
            "open_trajectories_after": open_after,
        },
        "m1": {
            "neighbour": _summary(loaded_lat),
            "neighbour_statuses": _counts([s for run in loaded for s in run[0]]),
            "p99_ratio": round(_p99(loaded_lat) / _p99(quiet_lat), 2),
            "streams_dropped": attack.dropped,
            "most_running": most.most,
            "aborted": server.engine.stats.aborted,
        },
    }


async def _worker(stack: Any, settings: Any, operator_key: str) -> tuple[Any, str, str]:
    """A started worker serving the demo policy, and two keys of `rtrl keys create`'s
    default budgets: the attacker's and the neighbour's."""
    from rtrl.api_keys import COMPLETIONS, KeyAuthority, issue_key
    from rtrl.inference.engine import Engine
    from rtrl.inference.server import start
    from rtrl.kafka import ensure_topics, wait_for_broker
    from rtrl.key_budgets import client_budgets
    from rtrl.policy import build_model, state_dict_fp32

    await asyncio.to_thread(wait_for_broker, stack)
    await asyncio.to_thread(ensure_topics, stack)
    server = await start(stack, settings)
    assert isinstance(server.engine, Engine)
    for arm in ("control", "treatment"):
        server.engine.stage(arm, 0, state_dict_fp32(build_model(seed=1)))
    authority, budgets = KeyAuthority(operator_key), client_budgets()

    async def key(client: str) -> str:
        return await issue_key(
            server.redis, authority, client, {COMPLETIONS}, budgets.rate_per_s, budgets.burst,
            max_concurrency=budgets.max_concurrency,
        )  # fmt: skip

    return server, await key("attacker"), await key("neighbour")


class _Agent:
    """The neighbour: open a trajectory, continue it, end it, each request timed."""

    def __init__(self, http: aiohttp.ClientSession, base: str, key: str) -> None:
        self.http, self.base = http, base
        self.headers = {"Authorization": f"Bearer {key}"}

    async def play(self, trajectory: str) -> tuple[list[int], list[float]]:
        url = f"{self.base}/{trajectory}/chat/completions"
        opening = {"role": "user", "content": "@p1 hi\n"}
        statuses, latencies = [], []
        started = time.monotonic()
        async with self.http.post(
            url, json={"messages": [opening], "max_tokens": 8}, headers=self.headers
        ) as resp:
            first = await resp.json()
            statuses.append(resp.status)
        latencies.append(time.monotonic() - started)
        if resp.status != 200:
            return statuses, latencies
        messages = [opening, first["choices"][0]["message"], {"role": "user", "content": "+"}]
        started = time.monotonic()
        async with self.http.post(
            url, json={"messages": messages, "max_tokens": 8}, headers=self.headers
        ) as resp:
            await resp.read()
            statuses.append(resp.status)
        latencies.append(time.monotonic() - started)
        started = time.monotonic()
        async with self.http.delete(f"{self.base}/{trajectory}", headers=self.headers) as resp:
            await resp.read()
            statuses.append(resp.status)
        latencies.append(time.monotonic() - started)
        await asyncio.sleep(AGENT_PACE_S)  # within its own key's rate, whatever the worker's speed
        return statuses, latencies


class _Attacker:
    """One default key: over-context first turns and dropped streams, each retried past a
    429 after its Retry-After (what its budget lets it send)."""

    def __init__(self, http: aiohttp.ClientSession, base: str, key: str) -> None:
        self.http, self.base = http, base
        self.headers = {"Authorization": f"Bearer {key}"}
        self.dropped = 0

    async def over_context(self, trajectory: str) -> int:
        body = {"messages": [{"role": "user", "content": OVER_CONTEXT}]}
        return await self._send(trajectory, body, stream=False)

    async def drop(self, trajectory: str) -> int:
        body = {
            "messages": [{"role": "user", "content": "@p1 say hi\n"}],
            "max_tokens": 100,
            "stream": True,
        }
        return await self._send(trajectory, body, stream=True)

    async def drop_at(self, rate_per_s: float) -> None:
        """Drop streams at ``rate_per_s``, each its own task, until cancelled."""
        tasks: set[asyncio.Task] = set()
        try:
            for i in range(10**9):
                task = asyncio.ensure_future(self.drop(f"flood-{i}"))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                await asyncio.sleep(1 / rate_per_s)
        finally:
            for task in tasks:
                task.cancel()

    async def _send(self, trajectory: str, body: dict, *, stream: bool) -> int:
        url = f"{self.base}/{trajectory}/chat/completions"
        while True:
            resp = await self.http.post(url, json=body, headers=self.headers)
            if resp.status == 429:
                retry = float(resp.headers.get("Retry-After", "1"))
                resp.close()
                await asyncio.sleep(min(retry, 1.0))
                continue
            if stream and resp.status == 200:
                await resp.content.readline()
                self.dropped += 1
            else:
                await resp.read()
            resp.close()
            return resp.status


class _MostRunning:
    """The most generations the engine ran at once, polled every 5 ms."""

    def __init__(self, engine: Any) -> None:
        self.most = 0
        self._engine = engine
        self._task = asyncio.ensure_future(self._poll())

    async def _poll(self) -> None:
        while True:
            self.most = max(self.most, self._engine.running())
            await asyncio.sleep(0.005)

    def stop(self) -> None:
        self._task.cancel()


def _counts(statuses: list[int]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for status in statuses:
        counts[str(status)] = counts.get(str(status), 0) + 1
    return counts


def _p99(latencies: list[float]) -> float:
    return statistics.quantiles(latencies, n=100)[98] if len(latencies) > 1 else latencies[0]


def _summary(latencies: list[float]) -> dict[str, Any]:
    return {
        "requests": len(latencies),
        "p50_s": round(statistics.median(latencies), 4),
        "p99_s": round(_p99(latencies), 4),
        "max_s": round(max(latencies), 4),
    }
