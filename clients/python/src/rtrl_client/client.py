"""The product side of ingest: build TelemetryEvents and publish them over HTTP.

``IngestClient.publish`` resends only what the gateway could not take (RETRY results,
429/5xx answers, connection errors) with exponential backoff and jitter, waiting at
least the ``Retry-After`` of a 429. Resending is safe because the gateway deduplicates
by event_id. A refused API key (401/403) raises ``IngestAuthError`` at once.

``rtrl_client.sdk`` builds the durable, batching client for product code on top of this.
"""

from __future__ import annotations

import asyncio
import json
import platform
import random
import time
import uuid
from collections.abc import Callable, Mapping, Sequence

import aiohttp
import aiohttp.abc
from google.protobuf import json_format

from rtrl_client.v1 import ingest_pb2, telemetry_pb2
from rtrl_client.version import SDK, SDK_HEADER

RETRY = ingest_pb2.EventResult.STATUS_RETRY
SCHEMA_VERSION = 1
USER_AGENT = (
    f"{SDK} {platform.python_implementation()}/{platform.python_version()} "
    f"aiohttp/{aiohttp.__version__}"
)
"""Every request's User-Agent: the SDK first, then what it runs on."""


class IngestError(RuntimeError):
    """The gateway refused a whole request (malformed or oversized): resending will not help."""


class IngestAuthError(IngestError):
    """The gateway refused the API key: missing, unknown or revoked (401), or not allowed
    to send these events (403). Resending with the same key will not help."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class IngestClient:
    def __init__(
        self,
        http_url: str,
        *,
        max_attempts: int = 8,
        base_delay_s: float = 0.05,
        max_delay_s: float = 2.0,
        timeout_s: float = 10.0,
        max_batch: int = 500,
        api_key: str | None = None,
        rng: random.Random | None = None,
        resolver_factory: Callable[[], aiohttp.abc.AbstractResolver] | None = None,
    ) -> None:
        """``resolver_factory``: host-name resolution for the session (aiohttp's threaded
        resolver by default), called on the loop that first publishes."""
        if max_attempts < 1 or max_batch < 1:
            raise ValueError("max_attempts and max_batch must be >= 1")
        self._url = http_url.rstrip("/") + "/v1/events"
        self._max_attempts = max_attempts
        self._base_delay_s = base_delay_s
        self._max_delay_s = max_delay_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._max_batch = max_batch
        self._headers = {
            "Content-Type": "application/json",
            "User-Agent": USER_AGENT,
            SDK_HEADER: SDK,
        }
        if api_key is not None:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._rng = rng or random.Random()
        self._resolver_factory = resolver_factory
        self._session: aiohttp.ClientSession | None = None

    async def publish(
        self, events: Sequence[telemetry_pb2.TelemetryEvent], *, traceparent: str = ""
    ) -> list[ingest_pb2.EventResult]:
        """One result per event, in order. Events still RETRY after the last attempt are
        returned as RETRY with the last error; everything else is final. ``traceparent``
        (the completion's, when the events are about one rollout) puts the gateway's
        span into the rollout's trace."""
        results: list[ingest_pb2.EventResult] = []
        for start in range(0, len(events), self._max_batch):
            results.extend(
                await self._publish_batch(events[start : start + self._max_batch], traceparent)
            )
        return results

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> IngestClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _publish_batch(
        self, events: Sequence[telemetry_pb2.TelemetryEvent], traceparent: str
    ) -> list[ingest_pb2.EventResult]:
        results: list[ingest_pb2.EventResult | None] = [None] * len(events)
        pending = list(range(len(events)))
        last_error = ""
        retry_after_s = 0.0
        for attempt in range(self._max_attempts):
            if attempt:
                await asyncio.sleep(max(self._backoff_s(attempt), retry_after_s))
            try:
                answer, retry_after_s = await self._post([events[i] for i in pending], traceparent)
            except _Throttled as exc:
                last_error, retry_after_s = str(exc), exc.retry_after_s
                continue
            except (
                # Not the builtin TimeoutError before Python 3.11, and aiohttp raises this one.
                asyncio.TimeoutError,
                aiohttp.ClientConnectionError,
                aiohttp.ClientPayloadError,
                _ServerError,
            ) as exc:
                last_error, retry_after_s = f"{type(exc).__name__}: {exc}", 0.0
                continue
            still_pending = []
            for i, result in zip(pending, answer.results, strict=True):
                results[i] = result
                if result.status == RETRY:
                    still_pending.append(i)
            pending = still_pending
            if not pending:
                break
        # Only events still pending can lack an answer: they get one that says we gave up.
        gave_up = f"gave up after {self._max_attempts} attempts: {last_error}"
        return [
            ingest_pb2.EventResult(event_id=events[i].event_id, status=RETRY, error=gave_up)
            if result is None
            else result
            for i, result in enumerate(results)
        ]

    async def _post(
        self, events: list[telemetry_pb2.TelemetryEvent], traceparent: str
    ) -> tuple[ingest_pb2.PublishEventsResponse, float]:
        """The gateway's answer and how long it asked us to wait before resending its RETRYs."""
        if self._session is None:
            connector = (
                aiohttp.TCPConnector(resolver=self._resolver_factory())
                if self._resolver_factory
                else None
            )
            self._session = aiohttp.ClientSession(timeout=self._timeout, connector=connector)
        body = json_format.MessageToJson(
            ingest_pb2.PublishEventsRequest(events=events), indent=None
        )
        headers = {**self._headers, "traceparent": traceparent} if traceparent else self._headers
        async with self._session.post(self._url, data=body, headers=headers) as response:
            text = await response.text()
            if response.status >= 500:
                raise _ServerError(f"HTTP {response.status}: {text[:200]}")
        try:
            document = json.loads(text) if text else {}
        except json.JSONDecodeError:
            document = {"error": text[:200]}
        message = document.get("error", text[:200]) if isinstance(document, dict) else text[:200]
        retry_after_s = (
            _retry_after_s(response.headers.get("Retry-After")) if response.status == 429 else 0.0
        )
        if response.status in (401, 403):
            raise IngestAuthError(response.status, message)
        if response.status == 429 and "error" in document:
            # Throttled as a whole (a rate limit), not per event: nothing was looked at.
            raise _Throttled(f"HTTP 429: {message}", retry_after_s)
        if "error" in document or response.status not in (200, 207, 400, 429):
            raise IngestError(f"HTTP {response.status}: {message}")
        answer = json_format.ParseDict(document, ingest_pb2.PublishEventsResponse())
        if len(answer.results) != len(events):
            raise IngestError(
                f"gateway answered {len(answer.results)} results for {len(events)} events"
            )
        return answer, retry_after_s

    def _backoff_s(self, attempt: int) -> float:
        # Half fixed, half random: spreads retries of many clients without ever retrying at once.
        ceiling = min(self._max_delay_s, self._base_delay_s * 2 ** (attempt - 1))
        return ceiling / 2 + self._rng.uniform(0, ceiling / 2)


class _ServerError(Exception):
    """A 5xx answer: the gateway or its dependencies failed; the request may be resent."""


class _Throttled(Exception):
    """A 429 refusing the whole request; resend after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def _retry_after_s(header: str | None) -> float:
    """Seconds from a ``Retry-After`` header; the HTTP-date form is read as 'soon'."""
    try:
        return max(0.0, float(header)) if header else 0.0
    except ValueError:
        return 0.0


def make_event(
    rollout_id: str,
    session_id: str,
    user_id: str,
    *,
    edit_shown: telemetry_pb2.EditShown | Mapping | None = None,
    persistence: telemetry_pb2.PersistenceSnapshot | Mapping | None = None,
    followup: telemetry_pb2.FollowUp | Mapping | None = None,
    edit_outcome: telemetry_pb2.EditOutcome
    | Mapping
    | telemetry_pb2.EditOutcome.Outcome
    | None = None,
    privacy_mode: bool = False,
    client_ts_ms: int | None = None,
) -> telemetry_pb2.TelemetryEvent:
    """A TelemetryEvent with a fresh uuid4 event_id and exactly one payload.

    ``edit_outcome`` may also be an ``EditOutcome.Outcome`` value.
    """
    if isinstance(edit_outcome, int):
        edit_outcome = telemetry_pb2.EditOutcome(outcome=edit_outcome)
    payloads = {
        "edit_shown": edit_shown,
        "persistence": persistence,
        "followup": followup,
        "edit_outcome": edit_outcome,
    }
    given = {name: value for name, value in payloads.items() if value is not None}
    if len(given) != 1:
        raise ValueError(
            f"give exactly one payload of {sorted(payloads)}, got {sorted(given) or 'none'}"
        )
    return telemetry_pb2.TelemetryEvent(
        event_id=str(uuid.uuid4()),
        rollout_id=rollout_id,
        session_id=session_id,
        user_id=user_id,
        client_ts_ms=time.time_ns() // 1_000_000 if client_ts_ms is None else client_ts_ms,
        schema_version=SCHEMA_VERSION,
        privacy_mode=privacy_mode,
        # The three not given are None, which protobuf leaves unset.
        edit_shown=edit_shown,
        persistence=persistence,
        followup=followup,
        edit_outcome=edit_outcome,
    )
