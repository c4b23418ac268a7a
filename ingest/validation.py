"""One validation path for every transport: a TelemetryEvent is either publishable
or rejected with the field at fault and the reason. Pure: no I/O, time passed in."""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

from rtrl.event_time import EventTimeWindow
from rtrl.field_bounds import MAX_ID_CHARS as MAX_ID_CHARS
from rtrl.field_bounds import MAX_PATH_BYTES as MAX_PATH_BYTES
from rtrl.field_bounds import MAX_TEXT_BYTES as MAX_TEXT_BYTES
from rtrl_client.v1 import telemetry_pb2

SCHEMA_VERSION = 1
# The defaults of IngestSettings.client_ts_max_future_s / client_ts_max_age_s.
CLIENT_TS_WINDOW = EventTimeWindow(max_future_ms=5 * 60 * 1000, max_age_ms=7 * 24 * 3600 * 1000)

_KNOWN_OUTCOMES = frozenset(
    {telemetry_pb2.EditOutcome.OUTCOME_ACCEPTED, telemetry_pb2.EditOutcome.OUTCOME_REJECTED}
)


@dataclass(frozen=True)
class Rejection:
    """Why an event can never be published; retrying it unchanged will not help."""

    field: str
    reason: str


def validate(
    event: telemetry_pb2.TelemetryEvent, now_ms: int, window: EventTimeWindow = CLIENT_TS_WINDOW
) -> Rejection | None:
    """The first problem with ``event`` at gateway time ``now_ms``, or None if it is
    publishable. ``client_ts_ms`` must lie in ``window`` around ``now_ms``."""
    return _envelope(event, now_ms, window) or _payload(event)


def _envelope(
    event: telemetry_pb2.TelemetryEvent, now_ms: int, window: EventTimeWindow
) -> Rejection | None:
    # The event_id is the dedup key of every hop, so only one spelling of a UUID is
    # accepted: "ABC…" and "abc…" must not pass as two different events.
    try:
        canonical = str(uuid.UUID(event.event_id))
    except ValueError:
        return Rejection("event_id", f"must be a UUID, got {_preview(event.event_id)}")
    if canonical != event.event_id:
        return Rejection(
            "event_id",
            f"must be a lowercase hyphenated UUID ({canonical}), got {_preview(event.event_id)}",
        )
    for name in ("rollout_id", "session_id", "user_id"):
        value = getattr(event, name)
        if not value.strip():
            return Rejection(name, "must be non-empty")
        if len(value) > MAX_ID_CHARS:
            return Rejection(name, f"must be at most {MAX_ID_CHARS} characters, got {len(value)}")
    if event.schema_version != SCHEMA_VERSION:
        return Rejection("schema_version", f"must be {SCHEMA_VERSION}, got {event.schema_version}")
    problem = window.problem(event.client_ts_ms, now_ms, "gateway clock")
    return Rejection("client_ts_ms", problem) if problem else None


def _payload(event: telemetry_pb2.TelemetryEvent) -> Rejection | None:
    kind = event.WhichOneof("payload")
    if kind is None:
        return Rejection(
            "payload", "must be one of edit_shown, edit_outcome, persistence, followup"
        )
    if kind == "edit_shown":
        return _text("edit_shown.file_path", event.edit_shown.file_path, MAX_PATH_BYTES) or _text(
            "edit_shown.edit_text", event.edit_shown.edit_text, MAX_TEXT_BYTES
        )
    if kind == "edit_outcome":
        if event.edit_outcome.outcome not in _KNOWN_OUTCOMES:
            return Rejection(
                "edit_outcome.outcome",
                f"must be OUTCOME_ACCEPTED or OUTCOME_REJECTED, got {event.edit_outcome.outcome}",
            )
        return None
    if kind == "persistence":
        return _delay(
            "persistence.seconds_after_edit", event.persistence.seconds_after_edit
        ) or _text("persistence.region_text", event.persistence.region_text, MAX_TEXT_BYTES)
    return _delay("followup.seconds_after_edit", event.followup.seconds_after_edit) or _text(
        "followup.message", event.followup.message, MAX_TEXT_BYTES
    )


def _text(field: str, value: str, limit: int) -> Rejection | None:
    size = len(value.encode("utf-8"))
    if size > limit:
        return Rejection(field, f"must be at most {limit} bytes of UTF-8, got {size}")
    return None


def _delay(field: str, seconds: float) -> Rejection | None:
    if not math.isfinite(seconds) or seconds < 0:
        return Rejection(field, f"must be a finite number >= 0, got {seconds}")
    return None


def _preview(value: str, limit: int = 48) -> str:
    return repr(value if len(value) <= limit else value[:limit] + "…")
