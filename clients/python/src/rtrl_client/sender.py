"""The SDK's background sender: one thread that delivers what a ``Spool`` holds.

``Telemetry`` (sdk.py) appends events to the spool and wakes the sender; the
sender takes the oldest events in batches (once ``linger_s`` has passed, a batch is full,
or a flush is waiting), sends them through ``IngestClient``'s retries on an event loop of
its own, and acks in the spool every event the gateway answered finally (ACCEPTED,
DUPLICATE, REJECTED). A round that gets no final answer (RETRY, the gateway down, a
refused key) backs off exponentially, with jitter, up to ``max_delay_s``; its events stay
spooled and are sent again.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp.abc
from aiohttp.abc import ResolveResult

from rtrl_client.client import IngestClient, IngestError
from rtrl_client.spool import Spool, SpooledEvent
from rtrl_client.v1 import ingest_pb2, telemetry_pb2

log = logging.getLogger("rtrl_client")

ACCEPTED = ingest_pb2.EventResult.STATUS_ACCEPTED
DUPLICATE = ingest_pb2.EventResult.STATUS_DUPLICATE
REJECTED = ingest_pb2.EventResult.STATUS_REJECTED


@dataclass(frozen=True)
class TelemetrySettings:
    max_batch: int = 500
    """Most events per request; at most the gateway's RTRL_INGEST_MAX_BATCH (1,000 by default)."""

    max_batch_bytes: int = 4 * 1024 * 1024
    """Most serialized event bytes per request. The JSON body is larger (up to ~6x for text
    full of escapes) and must stay under the gateway's RTRL_INGEST_MAX_BODY_BYTES (64 MiB)."""

    linger_s: float = 0.05
    """How long the sender waits for a batch to fill before sending a partial one: latency
    against requests. flush() and close() do not wait for it."""

    max_spool_bytes: int = 256 * 1024 * 1024
    """Disk the spool may use; a report beyond it raises SpoolFull instead of dropping anything."""

    segment_bytes: int = 4 * 1024 * 1024
    """Size at which the spool starts a new segment file. Space is freed a whole segment at
    a time, so one slow event holds at most this much disk."""

    fsync: bool = True
    """fsync each append before the call returns. Off, a report survives the process being
    killed (the page cache has it) but not the machine losing power."""

    request_timeout_s: float = 10.0
    """Total time of one HTTP request to the gateway."""

    attempts_per_round: int = 4
    """IngestClient attempts per batch before the sender puts the batch back and backs off
    (the events stay spooled and are resent forever)."""

    base_delay_s: float = 0.05
    """First backoff delay, both within a round and between rounds without progress."""

    max_delay_s: float = 5.0
    """Longest backoff between rounds without progress (gateway down, key refused)."""

    close_timeout_s: float = 10.0
    """How long close(), and the exit hook for clients never closed, wait for delivery."""

    max_rejected_kept: int = 1000
    """Most recent REJECTED events kept in Telemetry.rejected."""

    def __post_init__(self) -> None:
        if (
            min(self.max_batch, self.max_batch_bytes, self.attempts_per_round) < 1
            or self.max_rejected_kept < 0
        ):
            raise ValueError(
                "max_batch, max_batch_bytes and attempts_per_round must be >= 1, max_rejected_kept >= 0"
            )
        if (
            min(self.linger_s, self.base_delay_s, self.close_timeout_s) < 0
            or self.request_timeout_s <= 0
        ):
            raise ValueError(
                "linger_s, base_delay_s and close_timeout_s must be >= 0, request_timeout_s > 0"
            )
        if self.max_delay_s < self.base_delay_s:
            raise ValueError(
                f"max_delay_s ({self.max_delay_s}) must be >= base_delay_s ({self.base_delay_s})"
            )
        if not 0 < self.segment_bytes <= self.max_spool_bytes:
            raise ValueError(
                f"segment_bytes ({self.segment_bytes}) must be in 1..max_spool_bytes ({self.max_spool_bytes})"
            )


@dataclass(frozen=True)
class RejectedEvent:
    """Produced by the sender for an event the gateway REJECTED; consumed by on_rejected
    callbacks and readers of Telemetry.rejected. Final: the event is not resent."""

    event: telemetry_pb2.TelemetryEvent
    field: str
    error: str


@dataclass
class DeliveryStats:
    """The gateway's answers per event since this Telemetry started."""

    accepted: int = 0
    duplicate: int = 0
    """Events the gateway already had: resends after a lost answer, a cut or a restart."""
    rejected: int = 0
    retry: int = 0
    """RETRY answers, and events given up on after a round of connection errors or 5xx
    answers; all of them were sent again later."""
    refused_requests: int = 0
    """Requests the gateway refused whole (IngestError: a refused key, a malformed batch)."""

    @property
    def answered(self) -> int:
        return self.accepted + self.duplicate + self.rejected


class Sender:
    """The thread that sends a spool's events, started when this is built.

    ``stats``, ``rejected`` and ``last_error`` are written by the thread and read through
    ``Telemetry``. ``wake()`` after an append, ``wait_answered`` to flush, ``stop()`` once."""

    def __init__(
        self,
        spool: Spool,
        url: str,
        *,
        api_key: str | None,
        settings: TelemetrySettings,
        on_rejected: Callable[[RejectedEvent], None] | None,
    ) -> None:
        self.settings = settings
        self.stats = DeliveryStats()
        self.rejected: collections.deque[RejectedEvent] = collections.deque(
            maxlen=settings.max_rejected_kept
        )
        self.last_error: BaseException | None = None
        """Why the latest round delivered nothing; None after a round with answers."""
        self._spool = spool
        self._url = url
        self._api_key = api_key
        self._on_rejected = on_rejected
        self._wake = threading.Condition()
        self._hurry = 0  # flushes waiting: send partial batches without lingering
        self._stopping = False
        self._fatal: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._round: asyncio.Task | None = None
        self._thread = threading.Thread(target=self._run, name="rtrl-telemetry-sender", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Something was spooled: the sender looks again."""
        with self._wake:
            self._wake.notify_all()

    def wait_answered(self, target: int, timeout_s: float | None) -> bool:
        """Wait until every event up to spool seq ``target`` is answered; False on timeout
        or once the sender has stopped. Raises the gateway's IngestError when waiting
        longer cannot help, and RuntimeError when the sender thread failed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._wake:
            self._hurry += 1
            self._wake.notify_all()
            try:
                while self._spool.unanswered_through(target):
                    if self._fatal is not None:
                        raise RuntimeError("the telemetry sender thread failed") from self._fatal
                    if isinstance(self.last_error, IngestError):
                        raise self.last_error
                    if self._stopping and not self._thread.is_alive():
                        return False
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return False
                    self._wake.wait(remaining)
                return True
            finally:
                self._hurry -= 1

    def stop(self) -> bool:
        """Stop the thread, cancelling the round in flight; whether it ended (within
        request_timeout_s), so the spool may be closed."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
            loop, current = self._loop, self._round
        if loop is not None and current is not None and not loop.is_closed():
            # An answer lost here only means a resend (a DUPLICATE) at the next start.
            loop.call_soon_threadsafe(current.cancel)
        self._thread.join(timeout=self.settings.request_timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        s = self.settings
        client = IngestClient(
            self._url,
            api_key=self._api_key,
            max_attempts=s.attempts_per_round,
            base_delay_s=s.base_delay_s,
            max_delay_s=s.max_delay_s,
            timeout_s=s.request_timeout_s,
            max_batch=s.max_batch,
            resolver_factory=_InlineResolver,
        )
        try:
            self._rounds(loop, client)
        except BaseException as exc:
            log.exception("telemetry sender failed; events stay in %s", self._spool.directory)
            self._fatal = exc
        finally:
            loop.run_until_complete(client.close())
            loop.close()
            with self._wake:
                self._wake.notify_all()

    def _rounds(self, loop: asyncio.AbstractEventLoop, client: IngestClient) -> None:
        """Deliver batch after batch until stopped, backing off after rounds without progress."""
        s = self.settings
        rng = random.Random()
        idle_rounds = 0
        while True:
            backoff = 0.0
            if idle_rounds:
                ceiling = min(s.max_delay_s, s.base_delay_s * 2**idle_rounds)
                backoff = ceiling / 2 + rng.uniform(0, ceiling / 2)
            batch = self._next_batch(time.monotonic() + backoff)
            if batch is None:
                return
            with self._wake:
                if self._stopping:
                    return
                self._round = loop.create_task(self._deliver(client, batch))
            try:
                progressed = loop.run_until_complete(self._round)
            except asyncio.CancelledError:
                return
            finally:
                self._round = None
            idle_rounds = 0 if progressed else idle_rounds + 1

    def _next_batch(self, not_before: float) -> list[SpooledEvent] | None:
        """The next batch once there is one worth sending, or None when stopping."""
        s = self.settings
        with self._wake:
            while not self._stopping:
                now = time.monotonic()
                oldest_at = self._spool.oldest_spooled_at()
                if oldest_at is None or now < not_before:
                    self._wake.wait(None if oldest_at is None else not_before - now)
                    continue
                send_at = oldest_at + s.linger_s
                if len(self._spool) >= s.max_batch or self._hurry or now >= send_at:
                    return self._spool.oldest(s.max_batch, s.max_batch_bytes)
                self._wake.wait(send_at - now)
            return None

    async def _deliver(self, client: IngestClient, batch: list[SpooledEvent]) -> bool:
        """Send one batch; ack what got a final answer. Whether anything did."""
        events = [telemetry_pb2.TelemetryEvent.FromString(item.payload) for item in batch]
        try:
            results = await client.publish(events)
        except IngestError as exc:
            self._failed(exc)
            return False
        answered, rejected = [], []
        for item, event, result in zip(batch, events, results, strict=True):
            if result.status == ACCEPTED:
                self.stats.accepted += 1
            elif result.status == DUPLICATE:
                self.stats.duplicate += 1
            elif result.status == REJECTED:
                self.stats.rejected += 1
                rejected.append(RejectedEvent(event, result.field, result.error))
            else:
                self.stats.retry += 1
                continue
            answered.append(item.seq)
        self._spool.ack(answered)
        for rejection in rejected:
            self._report_rejected(rejection)
        self.last_error = (
            None
            if answered
            else RuntimeError(f"every event got RETRY, the first: {results[0].error}")
        )
        with self._wake:
            self._wake.notify_all()
        return bool(answered)

    def _report_rejected(self, rejection: RejectedEvent) -> None:
        log.warning(
            "telemetry event %s rejected by the gateway: %s: %s",
            rejection.event.event_id,
            rejection.field,
            rejection.error,
        )
        self.rejected.append(rejection)
        if self._on_rejected is not None:
            try:
                self._on_rejected(rejection)
            except Exception:  # the product's callback must not stop delivery of everything else
                log.exception(
                    "telemetry: on_rejected callback failed for event %s",
                    rejection.event.event_id,
                )

    def _failed(self, error: BaseException) -> None:
        self.stats.refused_requests += 1
        if isinstance(error, IngestError) and str(error) != str(self.last_error):
            log.error("telemetry: the gateway refused the request, events stay spooled: %s", error)
        self.last_error = error
        with self._wake:
            self._wake.notify_all()


class _InlineResolver(aiohttp.abc.AbstractResolver):
    """getaddrinfo on the sender's thread. aiohttp's default resolver hands it to a
    thread pool, and thread pools refuse work once the interpreter is exiting: exactly
    when the exit hook flushes clients that were never closed."""

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        infos = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, family=family, flags=socket.AI_ADDRCONFIG
        )
        return [
            ResolveResult(
                hostname=host,
                host=address[0],
                port=address[1],
                family=af,
                proto=proto,
                flags=socket.AI_NUMERICHOST,
            )
            for af, _, proto, _, address in infos
            # Always true of an IPv4/IPv6 address; it tells the type checker it is one.
            if af in (socket.AF_INET, socket.AF_INET6) and isinstance(address[0], str)
        ]

    async def close(self) -> None:
        pass
