"""Each version the engine swaps in, made known: logged, traced (the ``weights apply``
span) and written to Redis under APPLIED_KEY, where `rtrl status`, benches and tests read
which worker serves which version since when."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import redis.asyncio as aioredis
from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from rtrl import otel
from rtrl.inference.weights import WeightFollower

log = logging.getLogger("inference")
_tracer = trace.get_tracer("rtrl.inference")

APPLIED_KEY = "rtrl:applied:{arm}:{version}"
"""A hash: worker id -> when (ms since the epoch) it began serving that version."""


class AppliedVersions:
    """Takes the engine's ``on_applied(arm, version)`` on the engine thread and does the
    rest on the event loop, so the engine never waits on Redis."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        redis: aioredis.Redis,
        worker_id: str,
        followers: Sequence[WeightFollower],
    ) -> None:
        self._loop = loop
        self._redis = redis
        self._worker_id = worker_id
        self._followers = followers
        self._writes: set[asyncio.Task] = set()

    def from_engine_thread(self, arm: str, version: int) -> None:
        self._loop.call_soon_threadsafe(self._applied, arm, version, time.time_ns())

    async def drain(self) -> None:
        """Wait for the writes under way (the engine has stopped: no more come)."""
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)

    def _applied(self, arm: str, version: int, applied_ns: int) -> None:
        log.info("%s serving %s v%d", self._worker_id, arm, version)
        self._trace(arm, version, applied_ns)
        task = asyncio.create_task(self._write(arm, version, applied_ns // 1_000_000))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, arm: str, version: int, applied_ms: int) -> None:
        await self._redis.hset(
            APPLIED_KEY.format(arm=arm, version=version), self._worker_id, applied_ms
        )

    def _trace(self, arm: str, version: int, applied_ns: int) -> None:
        """The ``weights apply`` span: from the version staged to it serving, a child
        of the weight_sync commit (through the manifest's traceparent)."""
        staged = next(
            (found for f in self._followers if f.arm == arm and (found := f.staged(version))), None
        )
        if staged is None:
            # Not staged by this process: a test's engine, or SGLang's sidecar, which
            # traces its own.
            return
        traceparent, staged_ns = staged
        attributes: dict[str, AttributeValue] = {
            "rtrl.arm": arm,
            "rtrl.policy.version": version,
            "rtrl.worker_id": self._worker_id,
        }
        span = _tracer.start_span(
            "weights apply",
            context=otel.parent(traceparent),
            attributes=attributes,
            start_time=staged_ns,
        )
        span.end(end_time=applied_ns)
