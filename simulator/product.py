"""The simulated product: virtual clients asking inference for edits and reporting
what their users did through the ingest API, exactly like a real editor would.

Each client loops: pick a user, ask a worker for a completion, show it, and after a
short delay report the persistence snapshot (and a follow-up if the user wrote one).
A completion that asks a clarifying question is shown as a chat message, not as an
edit: the client reports no edit_shown and no snapshot (there is nothing to
persist), only the user's answer when there is one, and counts it as not persisted.
A small share of batches is sent twice on purpose, as flaky-network retries do:
the gateway must report them as duplicates and nothing downstream may count them.
With ``unique_prompts`` no prompt is ever asked twice (simulator.tasks.UniqueTasks).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from rtrl.simulator.tasks import UNIQUE_MAX_TOKENS, Task, UniqueTasks, random_task
from rtrl.simulator.users import Reaction, User, population, react
from rtrl_client.client import IngestClient, make_event
from rtrl_client.v1 import ingest_pb2, telemetry_pb2

ACCEPTED = ingest_pb2.EventResult.STATUS_ACCEPTED
DUPLICATE = ingest_pb2.EventResult.STATUS_DUPLICATE
DEFAULT_CLIENTS = 48
"""Editors the product runs at once, each with one completion in flight at a time."""


@dataclass
class ArmStats:
    completions: int = 0
    persisted: int = 0
    dissatisfied: int = 0
    questions: int = 0
    latency_s: list[float] = field(default_factory=list)
    recent: deque = field(
        default_factory=lambda: deque(maxlen=400)
    )  # (persisted, dissatisfied, asked)
    asked: list[tuple[float, bool]] = field(default_factory=list)
    """(seconds since the product started, asked a question?) per completion."""
    max_version: int = -1

    def recent_rates(self) -> tuple[float, float, float]:
        """Persisted, dissatisfied and question rates over the last 400 completions."""
        if not self.recent:
            return float("nan"), float("nan"), float("nan")
        n = len(self.recent)
        return tuple(sum(flags[i] for flags in self.recent) / n for i in range(3))

    def question_rates(self, bucket_s: float) -> list[tuple[float, int, float]]:
        """(bucket start in seconds, completions, share that asked) per bucket_s of the run."""
        buckets: dict[int, list[bool]] = {}
        for elapsed_s, asked in self.asked:
            buckets.setdefault(int(elapsed_s // bucket_s), []).append(asked)
        return [
            (b * bucket_s, len(flags), sum(flags) / len(flags))
            for b, flags in sorted(buckets.items())
        ]


@dataclass
class ProductStats:
    arms: dict[str, ArmStats] = field(
        default_factory=lambda: {"control": ArmStats(), "treatment": ArmStats()}
    )
    events_accepted: int = 0
    # Accepted from privacy-mode users: counted by the gateway, never written to a topic.
    events_private: int = 0
    events_duplicate_replies: int = 0
    events_failed: int = 0
    privacy_completions: int = 0
    private_user_ids: set[str] = field(default_factory=set)
    errors: int = 0
    last_error: str = ""
    started: float = field(default_factory=time.monotonic)
    landed_before: dict[str, int] = field(default_factory=dict)
    """What ClickHouse held when this run began (rollouts, events, rewards): a resumed
    stack keeps its earlier runs, and a drain waits for those plus this run's."""

    @property
    def completions(self) -> int:
        return sum(a.completions for a in self.arms.values())


def _event(
    user: User, rollout_id: str, session_id: str, ts_ms: int, **payload
) -> telemetry_pb2.TelemetryEvent:
    return make_event(
        rollout_id,
        session_id,
        user.user_id,
        privacy_mode=user.privacy_mode,
        client_ts_ms=ts_ms,
        **payload,
    )


class Product:
    def __init__(
        self,
        inference_urls: list[str],
        ingest_url: str,
        *,
        api_key: str | None = None,
        users: int = 400,
        clients: int = DEFAULT_CLIENTS,
        report_delay_s: float = 0.3,
        duplicate_share: float = 0.03,
        privacy_share: float = 0.03,
        seed: int = 7,
        unique_prompts: bool = False,
    ) -> None:
        self.inference_urls = inference_urls
        self.ingest = IngestClient(ingest_url, api_key=api_key)
        # The same key asks for completions (scope ``completions``) and reports telemetry.
        self._serving_headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.users = population(users, seed=seed, privacy_share=privacy_share)
        self.clients = clients
        self.report_delay_s = report_delay_s
        self.duplicate_share = duplicate_share
        self.rng = random.Random(seed)
        self.stats = ProductStats()
        self.unique_tasks = UniqueTasks() if unique_prompts else None
        self.deadline = 0.0
        self._reports: set[asyncio.Task] = set()

    async def run(self, duration_s: float) -> ProductStats:
        self.deadline = time.monotonic() + duration_s
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            await asyncio.gather(*(self._client(http, i) for i in range(self.clients)))
            if self._reports:
                await asyncio.gather(*self._reports)
        await self.ingest.close()
        return self.stats

    def stop(self) -> None:
        """End the run early: clients finish the edit in hand, and its report is still sent."""
        self.deadline = 0.0

    async def _client(self, http: aiohttp.ClientSession, index: int) -> None:
        rng = random.Random(self.rng.random())
        url = self.inference_urls[index % len(self.inference_urls)]
        while time.monotonic() < self.deadline:
            user = rng.choice(self.users)
            try:
                await self._one_edit(http, url, user, rng)
            except (TimeoutError, aiohttp.ClientError, RuntimeError) as exc:
                self.stats.errors += 1
                self.stats.last_error = f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(0.5)

    async def _one_edit(
        self, http: aiohttp.ClientSession, url: str, user: User, rng: random.Random
    ) -> None:
        if self.unique_tasks is None:
            task = random_task(rng, project=user.project)
        else:
            task = self.unique_tasks.draw(rng, project=user.project)
        session_id = f"s-{user.user_id}"
        completion = await self._complete(http, url, user, task, session_id)
        shown_ms = int(time.time() * 1000)
        reaction = react(user, task, completion["text"], rng)
        self._count(user, completion, reaction)
        rollout_id = completion["rollout_id"]
        shown = None
        if reaction.region_text is not None:
            shown = _event(
                user,
                rollout_id,
                session_id,
                shown_ms,
                edit_shown=telemetry_pb2.EditShown(
                    file_path=f"p{user.project}/helpers.py", edit_text=completion["text"]
                ),
            )
        self._later(
            self._report(
                user,
                rollout_id,
                completion.get("traceparent", ""),
                session_id,
                shown,
                reaction,
                rng.random(),
            )
        )

    def _later(self, report: Coroutine[Any, Any, None]) -> None:
        """Send a report once its delay has passed, without holding up the next edit (the run
        waits for every report before it ends)."""
        task = asyncio.create_task(report)
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def _complete(
        self, http: aiohttp.ClientSession, url: str, user: User, task: Task, session_id: str
    ) -> dict:
        """The worker's completion for the user's task (its JSON answer)."""
        body = {
            "prompt": task.prompt,
            "user_id": user.user_id,
            "session_id": session_id,
            "privacy_mode": user.privacy_mode,
        }
        if task.serial:
            body["max_tokens"] = UNIQUE_MAX_TOKENS
        return await self._serve(http, f"{url}/v1/completions", body)

    async def _serve(self, http: aiohttp.ClientSession, url: str, body: dict) -> dict:
        """The serving API's JSON answer to ``body`` (RuntimeError for any other status)."""
        async with http.post(url, json=body, headers=self._serving_headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"inference answered {resp.status}: {(await resp.text())[:200]}")
            return await resp.json()

    def _count(self, user: User, completion: dict, reaction: Reaction) -> None:
        """A completion shown and what the user did with it, in its arm's stats (a
        privacy-mode user's only as such: no arm counts it)."""
        if user.privacy_mode:
            self.stats.privacy_completions += 1
            self.stats.private_user_ids.add(user.user_id)
            return
        arm = self.stats.arms[completion["arm"]]
        arm.completions += 1
        arm.persisted += reaction.persisted_fraction >= 0.999
        arm.dissatisfied += reaction.dissatisfied
        asked = reaction.region_text is None
        arm.questions += asked
        arm.latency_s.append(completion["latency_s"])
        arm.recent.append((reaction.persisted_fraction >= 0.999, reaction.dissatisfied, asked))
        arm.asked.append((time.monotonic() - self.stats.started, asked))
        arm.max_version = max(
            [arm.max_version] + [span["version"] for span in completion["policy_versions"]]
        )

    async def _report(
        self,
        user: User,
        rollout_id: str,
        traceparent: str,
        session_id: str,
        shown,
        reaction,
        roll: float,
    ) -> None:
        await asyncio.sleep(self.report_delay_s)
        now_ms = int(time.time() * 1000)
        events = []
        if shown is not None:
            events += [
                shown,
                _event(
                    user,
                    rollout_id,
                    session_id,
                    now_ms,
                    persistence=telemetry_pb2.PersistenceSnapshot(
                        seconds_after_edit=self.report_delay_s, region_text=reaction.region_text
                    ),
                ),
            ]
        if reaction.followup:
            events.append(
                _event(
                    user,
                    rollout_id,
                    session_id,
                    now_ms,
                    followup=telemetry_pb2.FollowUp(
                        seconds_after_edit=self.report_delay_s, message=reaction.followup
                    ),
                )
            )
        if not events:
            return  # an unanswered question: the editor has nothing to report
        await self._send(events, user.privacy_mode, traceparent)
        if roll < self.duplicate_share:
            await self._send(
                events, user.privacy_mode, traceparent
            )  # a client retry of a batch that already landed

    async def _send(self, events, private: bool, traceparent: str) -> None:
        try:
            results = await self.ingest.publish(events, traceparent=traceparent)
        except Exception as exc:  # the SDK already retried; count what we could not deliver
            self.stats.events_failed += len(events)
            self.stats.last_error = f"ingest: {type(exc).__name__}: {exc}"
            return
        for result in results:
            if result.status == ACCEPTED and private:
                self.stats.events_private += 1
            elif result.status == ACCEPTED:
                self.stats.events_accepted += 1
            elif result.status == DUPLICATE:
                self.stats.events_duplicate_replies += 1
            else:
                self.stats.events_failed += 1
                self.stats.last_error = f"ingest rejected {result.field}: {result.error}"
