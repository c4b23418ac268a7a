"""What one client can do to the agent trajectories and engine rows of a worker it shares.

A turn is a transaction (inference/sessions.py, ``Sessions.turn``): whatever ends it (a
refusal, an engine error, a client gone mid-stream) releases its trajectory, and a stream
dropped mid-turn aborts its generation before its request leaves the key's budget. Open
trajectories are bounded per client as well as per worker, and a trajectory keeps the arm
it was opened with.

The worker serves the built-in demo policy (a 128-position context, its chat template the
messages' text). Its engine runs each decode step through a hook that records how many
requests are generating, and slows the steps down so that a stream dropped after its first
token is still generating when the worker next writes to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import aiohttp
import pytest
import torch

from rtrl.inference.arms import assign_arm
from rtrl.inference.config import InferenceSettings
from rtrl.inference.engine import Engine, EngineConfig
from rtrl.inference.server import InferenceServer, start
from rtrl.policy import build_model, state_dict_fp32
from support import wait
from support.keys import CreatedKey, create_key

pytestmark = pytest.mark.integration

torch.set_num_threads(1)

STEP_S = 0.01
"""How long each decode step is made to take: a 100-token stream generates for a second."""
OVER_CONTEXT = "x" * 200
"""A first turn longer than the demo policy's 128 positions: answered 400."""


class Rows:
    """The most requests the engine had generating at once, read after every decode step."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.most = 0

    def on_step(self, arm: str, generated: int) -> None:
        assert self.engine is not None
        self.most = max(self.most, self.engine.running())
        time.sleep(STEP_S)


@contextlib.asynccontextmanager
async def worker(stack_settings, rows: Rows | None = None, **overrides: Any):
    """A worker serving the demo policy, control at version 0 and treatment at version 1."""
    rows = rows or Rows()
    engine = Engine(EngineConfig(batch_wait_s=0.005), on_step=rows.on_step)
    rows.engine = engine
    settings = InferenceSettings(http_port=0, follow_weights=False, ready_timeout_s=60)
    server = await start(stack_settings, settings.model_copy(update=overrides), engine=engine)
    try:
        engine.stage("control", 0, state_dict_fp32(build_model(seed=1)))
        engine.stage("treatment", 1, state_dict_fp32(build_model(seed=2)))
        async with aiohttp.ClientSession() as http:
            yield server, http
    finally:
        await server.stop()


def keys(stack_settings, tmp_path, *clients: str) -> list[CreatedKey]:
    """Keys made by `rtrl keys create` with no budget flags: one client's default budgets."""
    return [
        create_key(stack_settings.redis_url, tmp_path / "no-stack", c, "--events", "completions")
        for c in clients
    ]


async def turn(
    http: aiohttp.ClientSession, server: InferenceServer, key: CreatedKey, trajectory: str, **body
) -> tuple[int, dict]:
    """One chat turn of ``trajectory`` (named in the path), answered whole."""
    url = f"http://127.0.0.1:{server.port}/v1/trajectories/{trajectory}/chat/completions"
    body = {"max_tokens": 8, "seed": 1} | body
    async with http.post(url, json=body, headers={"Authorization": f"Bearer {key.key}"}) as resp:
        return resp.status, await resp.json()


async def end(
    http: aiohttp.ClientSession, server: InferenceServer, key: CreatedKey, trajectory: str
) -> tuple[int, dict]:
    url = f"http://127.0.0.1:{server.port}/v1/trajectories/{trajectory}"
    async with http.delete(url, headers={"Authorization": f"Bearer {key.key}"}) as resp:
        return resp.status, await resp.json()


async def dropped_stream(
    http: aiohttp.ClientSession, server: InferenceServer, key: CreatedKey, trajectory: str
) -> int:
    """A streamed turn whose client goes away after its first token; its status (200, or
    429 when the key's completions in flight are spent)."""
    url = f"http://127.0.0.1:{server.port}/v1/trajectories/{trajectory}/chat/completions"
    body = {
        "messages": [{"role": "user", "content": "@p1 say hi\n"}],
        "max_tokens": 100,
        "temperature": 0,
        "stream": True,
    }
    resp = await http.post(url, json=body, headers={"Authorization": f"Bearer {key.key}"})
    if resp.status == 200:
        await resp.content.readline()  # the first token's chunk
    resp.close()  # the connection goes with it
    return resp.status


def user_in(arm: str) -> str:
    return next(u for u in (f"user-{i}" for i in range(1000)) if assign_arm(u, 0.5) == arm)


async def open_continue_end(
    http: aiohttp.ClientSession, server: InferenceServer, key: CreatedKey, trajectory: str
) -> list[int]:
    """A well-behaved agent: a first turn, a second one extending it, then its end."""
    first_message = {"role": "user", "content": "@p1 hi\n"}
    status, first = await turn(http, server, key, trajectory, messages=[first_message])
    if status != 200:
        return [status]
    answered = first["choices"][0]["message"]
    messages = [first_message, answered, {"role": "user", "content": "more\n"}]
    status2, second = await turn(http, server, key, trajectory, messages=messages)
    ended, body = await end(http, server, key, trajectory)
    same = second.get("rollout_id") == first["rollout_id"] and body.get("turns") == 2
    return [status, status2, ended, int(same)]


@pytest.mark.guarantee(7)
def test_refused_and_dropped_turns_release_their_trajectories_so_another_client_is_served(
    stack_settings, tmp_path
):
    """H1: over-context first turns (400) and streams dropped mid-turn, from one default
    key, used to leave their trajectories busy forever: the sweep and the LRU skipped them,
    and once the worker's trajectories were all "mid-turn" every other client got 409."""
    attacker, neighbour = keys(stack_settings, tmp_path, "agent-a", "agent-b")

    async def scenario():
        async with worker(stack_settings, max_trajectories=8) as (server, http):
            refused = [
                await turn(
                    http, server, attacker, f"long-{i}",
                    messages=[{"role": "user", "content": OVER_CONTEXT}],
                )
                for i in range(24)
            ]  # fmt: skip
            dropped = []
            for i in range(12):
                dropped.append(await dropped_stream(http, server, attacker, f"drop-{i}"))
                await wait.until_async(
                    lambda: not server.door.in_flight[attacker.digest],
                    "the dropped stream's request ended",
                )
            served = await open_continue_end(http, server, neighbour, "n-1")
            return refused, dropped, served, len(server.api.sessions)

    refused, dropped, served, still_open = asyncio.run(scenario())
    assert {status for status, _ in refused} == {400}
    error = refused[0][1]["error"]
    assert error["type"] == "invalid_request_error" and "prompt is" in error["message"]
    assert dropped == [200] * 12
    assert served == [200, 200, 200, 1], served
    assert still_open == 0


@pytest.mark.guarantee(7)
def test_dropped_streams_never_run_more_generations_than_the_keys_budget(stack_settings, tmp_path):
    """M1: a stream dropped mid-turn freed its request's place in the key's budget while
    its generation ran on, so a key dropping streams ran more generations than its budget."""
    (flooder,) = keys(stack_settings, tmp_path, "dropper")
    budget = int(flooder.record["max_concurrency"])
    rows = Rows()

    async def dropper(http, server, n: int, drops: list[int]) -> None:
        for i in range(6):
            while (status := await dropped_stream(http, server, flooder, f"d{n}-{i}")) == 429:
                await wait.until_async(
                    lambda: server.door.in_flight[flooder.digest] < budget, "a request ended"
                )
            drops.append(status)

    async def scenario() -> list[int]:
        async with worker(stack_settings, rows) as (server, http):
            drops: list[int] = []
            await asyncio.gather(*(dropper(http, server, n, drops) for n in range(budget)))
            await wait.until_async(
                lambda: not server.door.in_flight[flooder.digest], "every request ended"
            )
            return drops

    drops = asyncio.run(scenario())
    assert drops == [200] * (6 * budget)
    assert rows.most <= budget, f"{rows.most} generations at once for a budget of {budget}"
    assert rows.engine is not None and rows.engine.stats.aborted > 0


@pytest.mark.guarantee(7)
def test_one_clients_trajectories_never_end_anothers(stack_settings, tmp_path):
    """M4: one LRU for every client: another client's new trajectories ended an open one,
    whose next turn then silently started a new rollout."""
    alice, bob = keys(stack_settings, tmp_path, "agent-alice", "agent-bob")

    async def scenario():
        async with worker(stack_settings, max_trajectories=4, max_trajectories_per_client=2) as (
            server,
            http,
        ):
            opening = {"role": "user", "content": "@p1 hi\n"}
            status, first = await turn(http, server, alice, "a-1", messages=[opening])
            assert status == 200, first
            bobs = [await turn(http, server, bob, f"b-{i}", messages=[opening]) for i in range(6)]
            evicted = await turn(http, server, bob, "b-0", messages=[opening])
            messages = [opening, first["choices"][0]["message"], {"role": "user", "content": "+"}]
            status2, second = await turn(http, server, alice, "a-1", messages=messages)
            return first, bobs, evicted, (status2, second)

    first, bobs, evicted, (status2, second) = asyncio.run(scenario())
    # Bob's third and later trajectories end his own least recently used ones, never Alice's.
    assert [status for status, _ in bobs] == [200] * 6
    assert status2 == 200, second
    assert second["rollout_id"] == first["rollout_id"]
    assert second["trajectory"] == {"id": "a-1", "link": 0, "turn": 1}
    # ...and the evicted one's next turn is told so, once, instead of silently starting anew.
    status, body = evicted
    assert status == 409 and "ended by this worker" in body["error"]["message"], body


@pytest.mark.guarantee(7)
def test_a_full_worker_refuses_a_newcomer_rather_than_end_another_clients_trajectory(
    stack_settings, tmp_path
):
    """M4: with the worker's trajectories all held by other clients, a newcomer is refused
    (503, OpenAI's shape, Retry-After) and the others' trajectories stay open."""
    alice, bob = keys(stack_settings, tmp_path, "agent-alice", "agent-bob")

    async def scenario():
        async with worker(stack_settings, max_trajectories=2) as (server, http):
            opening = {"role": "user", "content": "@p1 hi\n"}
            held = [await turn(http, server, alice, f"a-{i}", messages=[opening]) for i in (0, 1)]
            url = f"http://127.0.0.1:{server.port}/v1/trajectories/b-0/chat/completions"
            headers = {"Authorization": f"Bearer {bob.key}"}
            async with http.post(url, json={"messages": [opening]}, headers=headers) as resp:
                refused = resp.status, await resp.json(), resp.headers.get("Retry-After")
            ended = [await end(http, server, alice, f"a-{i}") for i in (0, 1)]
            return held, refused, ended

    held, (status, body, retry_after), ended = asyncio.run(scenario())
    assert [s for s, _ in held] == [200, 200]
    assert status == 503 and body["error"]["type"] == "server_error", body
    assert "trajectories" in body["error"]["message"] and retry_after is not None
    assert [s for s, _ in ended] == [200, 200]


@pytest.mark.guarantee(7)
def test_a_trajectory_keeps_the_arm_it_was_opened_with(stack_settings, tmp_path):
    """L2: a turn continuing a treatment user's trajectory under a control user's id was
    sampled by control's version and recorded as treatment's."""
    (agent,) = keys(stack_settings, tmp_path, "agent-arms")
    treated, control = user_in("treatment"), user_in("control")

    async def scenario():
        async with worker(stack_settings) as (server, http):
            opening = {"role": "user", "content": "@p1 hi\n"}
            status, first = await turn(http, server, agent, "t-1", messages=[opening], user=treated)
            assert status == 200, first
            history = [opening, first["choices"][0]["message"]]
            other = await turn(
                http, server, agent, "t-1",
                messages=[*history, {"role": "user", "content": "a"}], user=control,
            )  # fmt: skip
            unnamed = await turn(
                http, server, agent, "t-1", messages=[*history, {"role": "user", "content": "b"}]
            )
            return first, other, unnamed

    first, (other_status, other), (status, unnamed) = asyncio.run(scenario())
    assert first["arm"] == "treatment"
    assert other_status == 400 and other["error"]["param"] == "user", other
    assert status == 200, unnamed
    assert unnamed["arm"] == "treatment"
    assert [v["version"] for v in unnamed["policy_versions"]] == [1]
