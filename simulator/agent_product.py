"""The agentic simulated product: virtual editors running an agent harness against the
serving API, the way an agent built on the OpenAI SDK does, and reporting what their users
did with the final edit.

Each trajectory: the user's task as the first message, the tools offered
(simulator/agent.py), ``POST /v1/chat/completions`` with a ``trajectory_id``; a turn with
``tool_calls`` is answered as an editor would, after the slowest call's time, with a
``role: "tool"`` message per call, and asked again; a turn without calls is the answer.
Then ``DELETE /v1/trajectories/{id}`` ends the trajectory (its record is written now), the
user judges the final edit (simulator/users.py: only the edit counts, not how it was
reached) and the editor reports it against the trajectory's rollout id, as the
single-turn product does. Latency is what the user waited: from the first request to the
final answer, tool time included.

Prompts are unique (simulator/tasks.py's serials). The requests name no ``context_key``, so
the trainer's context baseline is one running mean over every trajectory (ops/demo.py,
AGENT_TRAINER): a task the policy is likely to fail (p4 without a written style) then scores
below it whatever the policy does there, the pressure a hackable reward (a1h) turns into
broken calls. A mean per project would hide that pressure, and the hack with it.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from rtrl.simulator.agent import AGENT_MAX_TOKENS, MAX_TURNS, TOOLS, observe, turn_latency_s
from rtrl.simulator.product import ArmStats, Product, _event
from rtrl.simulator.tasks import Task
from rtrl.simulator.users import User, react
from rtrl_client.v1 import telemetry_pb2

OFFERED = [tool.openai() for tool in TOOLS]


@dataclass
class AgentArmStats(ArmStats):
    """An arm's trajectories: ArmStats, plus how the agent worked."""

    turns: list[int] = field(default_factory=list)
    tool_calls: list[int] = field(default_factory=list)
    parallel_turns: int = 0
    truncated: int = 0


@dataclass
class Played:
    """A trajectory as the harness saw it."""

    text: str
    rollout_id: str
    arm: str
    traceparent: str
    versions: list[int]
    turns: int = 0
    calls: int = 0
    parallel_turns: int = 0
    truncated: bool = False
    answered: float = 0.0
    """When the final answer came (monotonic): the user's wait ends there, not at the
    trajectory's DELETE."""


class AgentProduct(Product):
    """The simulated product with an agent harness in every editor (the module's docstring)."""

    def __init__(self, inference_urls: list[str], ingest_url: str, **options: Any) -> None:
        options["unique_prompts"] = True
        super().__init__(inference_urls, ingest_url, **options)
        self.stats.arms = {"control": AgentArmStats(), "treatment": AgentArmStats()}

    async def _one_edit(
        self, http: aiohttp.ClientSession, url: str, user: User, rng: random.Random
    ) -> None:
        assert self.unique_tasks is not None
        task = self.unique_tasks.draw(rng, project=user.project)
        session_id = f"s-{user.user_id}"
        started = time.monotonic()
        played = await self._play(http, url, user, task, session_id)
        wall_s = played.answered - started
        reaction = react(user, task, played.text, rng)
        shown_ms = int(time.time() * 1000)
        answer = {
            "arm": played.arm,
            "latency_s": wall_s,
            "policy_versions": [{"version": v} for v in played.versions],
        }
        self._count(user, answer, reaction)
        if not user.privacy_mode:
            arm = self.stats.arms[played.arm]
            assert isinstance(arm, AgentArmStats)
            arm.turns.append(played.turns)
            arm.tool_calls.append(played.calls)
            arm.parallel_turns += played.parallel_turns
            arm.truncated += played.truncated
        shown = None
        if reaction.region_text is not None:
            shown = self._shown(user, played, session_id, shown_ms)
        self._later(
            self._report(
                user,
                played.rollout_id,
                played.traceparent,
                session_id,
                shown,
                reaction,
                rng.random(),
            )
        )

    def _shown(
        self, user: User, played: Played, session_id: str, shown_ms: int
    ) -> telemetry_pb2.TelemetryEvent:
        edit = telemetry_pb2.EditShown(
            file_path=f"p{user.project}/helpers.py", edit_text=played.text
        )
        return _event(user, played.rollout_id, session_id, shown_ms, edit_shown=edit)

    async def _play(
        self, http: aiohttp.ClientSession, url: str, user: User, task: Task, session_id: str
    ) -> Played:
        """The trajectory, turn by turn, then ended."""
        trajectory_id = f"t-{uuid.uuid4().hex}"
        messages: list[dict[str, Any]] = [{"role": "user", "content": task.prompt}]
        body = {
            "tools": OFFERED,
            "trajectory_id": trajectory_id,
            "user_id": user.user_id,
            "session_id": session_id,
            "privacy_mode": user.privacy_mode,
            "max_tokens": AGENT_MAX_TOKENS,
        }
        played: Played | None = None
        try:
            for _ in range(MAX_TURNS):
                answer = await self._serve(
                    http, f"{url}/v1/chat/completions", {**body, "messages": messages}
                )
                message = answer["choices"][0]["message"]
                if played is None:
                    played = Played(
                        "", answer["rollout_id"], answer["arm"], answer.get("traceparent", ""), []
                    )
                played.turns += 1
                played.versions += [span["version"] for span in answer["policy_versions"]]
                calls = message.get("tool_calls") or []
                if not calls:
                    played.text = message.get("content") or ""
                    played.answered = time.monotonic()
                    return played
                played.calls += len(calls)
                played.parallel_turns += len(calls) > 1
                messages.append(
                    {"role": "assistant", "content": message.get("content"), "tool_calls": calls}
                )
                names = [call["function"]["name"] for call in calls]
                await asyncio.sleep(turn_latency_s(names))
                messages += [
                    {
                        "role": "tool",
                        "tool_call_id": call["id"],
                        "content": observe(name, user.written_style),
                    }
                    for call, name in zip(calls, names, strict=True)
                ]
            assert played is not None
            played.truncated = True  # the harness gives up: nothing to show
            played.answered = time.monotonic()
            return played
        finally:
            await self._end(http, url, trajectory_id)

    async def _end(self, http: aiohttp.ClientSession, url: str, trajectory_id: str) -> None:
        """End the trajectory: its record is written now, not after the idle timeout."""
        async with http.delete(
            f"{url}/v1/trajectories/{trajectory_id}", headers=self._serving_headers
        ) as resp:
            await resp.read()
