"""Every way an event can be unpublishable is named by field and reason."""

import pytest

from rtrl.ingest.validation import MAX_TEXT_BYTES, validate
from rtrl_client.client import make_event
from rtrl_client.v1 import telemetry_pb2

NOW_MS = 1_800_000_000_000
DAY_MS = 24 * 3600 * 1000


def good() -> telemetry_pb2.TelemetryEvent:
    return make_event(
        "rollout-1",
        "session-1",
        "user-1",
        edit_shown=telemetry_pb2.EditShown(file_path="a.py", edit_text="x = 1\n"),
        client_ts_ms=NOW_MS,
    )


def with_(**changes):
    def build():
        event = good()
        for name, value in changes.items():
            setattr(event, name, value)
        return event

    return build


def payload(name, **fields):
    def build():
        event = good()
        getattr(event, name).SetInParent()
        for key, value in fields.items():
            setattr(getattr(event, name), key, value)
        return event

    return build


def no_payload():
    event = good()
    event.ClearField("edit_shown")
    return event


@pytest.mark.parametrize(
    "build, field, reason_part",
    [
        # the dedup key must be one canonical spelling of a UUID
        (with_(event_id=""), "event_id", "must be a UUID"),
        (with_(event_id="not-a-uuid"), "event_id", "must be a UUID"),
        (with_(event_id="3F2504E0-4F89-11D3-9A0C-0305E82C3301"), "event_id", "lowercase"),
        (with_(event_id="{3f2504e0-4f89-11d3-9a0c-0305e82c3301}"), "event_id", "lowercase"),
        # join keys
        (with_(rollout_id=""), "rollout_id", "non-empty"),
        (with_(session_id="   "), "session_id", "non-empty"),
        (with_(user_id=""), "user_id", "non-empty"),
        (with_(rollout_id="r" * 129), "rollout_id", "at most 128"),
        # contract version
        (with_(schema_version=0), "schema_version", "must be 1"),
        (with_(schema_version=2), "schema_version", "must be 1"),
        # event time outside [now - 7 d, now + 5 min]
        (with_(client_ts_ms=NOW_MS - 7 * DAY_MS - 1), "client_ts_ms", "7 days"),
        (with_(client_ts_ms=NOW_MS + 5 * 60 * 1000 + 1), "client_ts_ms", "5 minutes"),
        (with_(client_ts_ms=0), "client_ts_ms", "7 days"),
        # payload
        (no_payload, "payload", "must be one of"),
        (payload("edit_outcome"), "edit_outcome.outcome", "OUTCOME_ACCEPTED"),
        (payload("edit_outcome", outcome=7), "edit_outcome.outcome", "got 7"),
        (
            payload("edit_shown", edit_text="x" * (MAX_TEXT_BYTES + 1)),
            "edit_shown.edit_text",
            "at most 65536 bytes",
        ),
        (
            payload("edit_shown", edit_text="é" * (MAX_TEXT_BYTES // 2 + 1)),
            "edit_shown.edit_text",
            "bytes of UTF-8",
        ),
        (payload("edit_shown", file_path="p" * 5000), "edit_shown.file_path", "at most"),
        (
            payload("persistence", region_text="x" * (MAX_TEXT_BYTES + 1)),
            "persistence.region_text",
            "at most",
        ),
        (payload("persistence", seconds_after_edit=-1.0), "persistence.seconds_after_edit", ">= 0"),
        (
            payload("followup", seconds_after_edit=float("nan")),
            "followup.seconds_after_edit",
            "finite",
        ),
        (payload("followup", message="m" * (MAX_TEXT_BYTES + 1)), "followup.message", "at most"),
    ],
)
def test_bad_event_is_rejected_with_field_and_reason(build, field, reason_part):
    rejection = validate(build(), NOW_MS)
    assert rejection is not None
    assert rejection.field == field
    assert reason_part in rejection.reason


@pytest.mark.parametrize(
    "build",
    [
        good,
        with_(client_ts_ms=NOW_MS - 7 * DAY_MS),
        with_(client_ts_ms=NOW_MS + 5 * 60 * 1000),
        with_(privacy_mode=True),
        payload("edit_outcome", outcome=telemetry_pb2.EditOutcome.OUTCOME_REJECTED),
        payload("persistence", seconds_after_edit=30.0, region_text=""),
        payload("followup", seconds_after_edit=0.0, message="no, that broke the build"),
        payload("edit_shown", edit_text="x" * MAX_TEXT_BYTES),
    ],
)
def test_good_event_passes(build):
    assert validate(build(), NOW_MS) is None


def test_make_event_wants_exactly_one_payload():
    with pytest.raises(ValueError, match="exactly one payload"):
        make_event("r", "s", "u")
    outcome = telemetry_pb2.EditOutcome.OUTCOME_ACCEPTED
    with pytest.raises(ValueError, match="exactly one payload"):
        make_event(
            "r", "s", "u", edit_outcome=outcome, followup=telemetry_pb2.FollowUp(message="x")
        )
