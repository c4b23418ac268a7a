"""The product side of ingest: build TelemetryEvents and publish them over HTTP.

``IngestClient.publish`` resends only what the gateway could not take (RETRY results,
429/5xx answers, connection errors) with exponential backoff and jitter. Resending is
safe because the gateway deduplicates by event_id.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from typing import Mapping, Sequence

import aiohttp
from google.protobuf import json_format

from rtrl.v1 import ingest_pb2, telemetry_pb2

RETRY = ingest_pb2.EventResult.STATUS_RETRY
SCHEMA_VERSION = 1


class IngestError(RuntimeError):
    """The gateway refused a whole request (malformed or oversized): resending will not help."""


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
        rng: random.Random | None = None,
    ) -> None:
        if max_attempts < 1 or max_batch < 1:
            raise ValueError("max_attempts and max_batch must be >= 1")
        self._url = http_url.rstrip("/") + "/v1/events"
        self._max_attempts = max_attempts
        self._base_delay_s = base_delay_s
        self._max_delay_s = max_delay_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._max_batch = max_batch
        self._rng = rng or random.Random()
        self._session: aiohttp.ClientSession | None = None

    async def publish(self, events: Sequence[telemetry_pb2.TelemetryEvent]) -> list[ingest_pb2.EventResult]:
        """One result per event, in order. Events still RETRY after the last attempt are
        returned as RETRY with the last error; everything else is final."""
        results: list[ingest_pb2.EventResult] = []
        for start in range(0, len(events), self._max_batch):
            results.extend(await self._publish_batch(events[start : start + self._max_batch]))
        return results

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> IngestClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _publish_batch(self, events: Sequence[telemetry_pb2.TelemetryEvent]) -> list[ingest_pb2.EventResult]:
        results: list[ingest_pb2.EventResult | None] = [None] * len(events)
        pending = list(range(len(events)))
        last_error = ""
        for attempt in range(self._max_attempts):
            if attempt:
                await asyncio.sleep(self._backoff_s(attempt))
            try:
                answer = await self._post([events[i] for i in pending])
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError, _ServerError) as exc:
                last_error = f"{type(exc).__name__}: {exc}"
                continue
            still_pending = []
            for i, result in zip(pending, answer.results):
                results[i] = result
                if result.status == RETRY:
                    still_pending.append(i)
            pending = still_pending
            if not pending:
                break
        for i in pending:
            if results[i] is None:
                results[i] = ingest_pb2.EventResult(
                    event_id=events[i].event_id, status=RETRY, error=f"gave up after {self._max_attempts} attempts: {last_error}"
                )
        return results

    async def _post(self, events: list[telemetry_pb2.TelemetryEvent]) -> ingest_pb2.PublishEventsResponse:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        body = json_format.MessageToJson(ingest_pb2.PublishEventsRequest(events=events), indent=None)
        async with self._session.post(self._url, data=body, headers={"Content-Type": "application/json"}) as response:
            text = await response.text()
            if response.status >= 500:
                raise _ServerError(f"HTTP {response.status}: {text[:200]}")
        try:
            document = json.loads(text) if text else {}
        except json.JSONDecodeError:
            document = {"error": text[:200]}
        if "error" in document or response.status not in (200, 207, 400, 429):
            raise IngestError(f"HTTP {response.status}: {document.get('error', text[:200])}")
        answer = json_format.ParseDict(document, ingest_pb2.PublishEventsResponse())
        if len(answer.results) != len(events):
            raise IngestError(f"gateway answered {len(answer.results)} results for {len(events)} events")
        return answer

    def _backoff_s(self, attempt: int) -> float:
        # Half fixed, half random: spreads retries of many clients without ever retrying at once.
        ceiling = min(self._max_delay_s, self._base_delay_s * 2 ** (attempt - 1))
        return ceiling / 2 + self._rng.uniform(0, ceiling / 2)


class _ServerError(Exception):
    """A 5xx answer: the gateway or its dependencies failed; the request may be resent."""


def make_event(
    rollout_id: str,
    session_id: str,
    user_id: str,
    *,
    edit_shown: telemetry_pb2.EditShown | Mapping | None = None,
    persistence: telemetry_pb2.PersistenceSnapshot | Mapping | None = None,
    followup: telemetry_pb2.FollowUp | Mapping | None = None,
    edit_outcome: telemetry_pb2.EditOutcome | Mapping | int | None = None,
    privacy_mode: bool = False,
    client_ts_ms: int | None = None,
) -> telemetry_pb2.TelemetryEvent:
    """A TelemetryEvent with a fresh uuid4 event_id and exactly one payload.

    ``edit_outcome`` may also be an ``EditOutcome.Outcome`` value.
    """
    if isinstance(edit_outcome, int):
        edit_outcome = telemetry_pb2.EditOutcome(outcome=edit_outcome)
    payloads = {"edit_shown": edit_shown, "persistence": persistence, "followup": followup, "edit_outcome": edit_outcome}
    given = {name: value for name, value in payloads.items() if value is not None}
    if len(given) != 1:
        raise ValueError(f"give exactly one payload of {sorted(payloads)}, got {sorted(given) or 'none'}")
    return telemetry_pb2.TelemetryEvent(
        event_id=str(uuid.uuid4()),
        rollout_id=rollout_id,
        session_id=session_id,
        user_id=user_id,
        client_ts_ms=time.time_ns() // 1_000_000 if client_ts_ms is None else client_ts_ms,
        schema_version=SCHEMA_VERSION,
        privacy_mode=privacy_mode,
        **given,
    )
