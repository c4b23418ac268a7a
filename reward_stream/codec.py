"""Kafka record -> join Event, with the checks that decide what goes to the DLQ."""

from __future__ import annotations

from google.protobuf.message import DecodeError

from reward_stream.join import Event
from rtrl import topics
from rtrl.v1 import rollout_pb2, telemetry_pb2


class MalformedEvent(ValueError):
    """The record cannot be joined; str(exc) is the reason put in the DLQ header."""


class UnauthenticatedRollout(MalformedEvent):
    """A rollout record the inference workers did not sign (forged, tampered or unsigned)."""


class PrivacyModeEvent(Exception):
    """An event from a user in privacy mode that should never have reached a topic.

    It is dropped, not dead-lettered: the DLQ is a topic too.
    """


def decode(topic: str, key: bytes | None, value: bytes | None, handle: object = None, caught_up: bool = True) -> Event:
    if not value:
        raise MalformedEvent("empty value")
    message: rollout_pb2.RolloutRecord | telemetry_pb2.TelemetryEvent
    try:
        if topic == topics.ROLLOUT:
            message = rollout_pb2.RolloutRecord.FromString(value)
            kind = "rollout"
        else:
            message = telemetry_pb2.TelemetryEvent.FromString(value)
            kind = message.WhichOneof("payload")
    except DecodeError as exc:
        raise MalformedEvent(f"protobuf decode failed: {exc}") from exc
    if kind is None:
        raise MalformedEvent("TelemetryEvent without payload")
    if kind != "rollout" and topics.BY_PAYLOAD.get(kind) != topic:
        raise MalformedEvent(f"payload {kind} does not belong on {topic}")
    if kind != "rollout" and message.privacy_mode:
        raise PrivacyModeEvent(message.event_id)
    if not message.event_id:
        raise MalformedEvent("missing event_id")
    if not message.rollout_id:
        raise MalformedEvent("missing rollout_id")
    if message.client_ts_ms == 0:
        raise MalformedEvent("missing client_ts_ms")
    if message.client_ts_ms < 0:
        raise MalformedEvent(f"client_ts_ms {message.client_ts_ms} is negative")
    # The join relies on co-partitioning by rollout_id; a record keyed otherwise sits
    # on the wrong partition and would be joined with nothing.
    if key is not None and key != message.rollout_id.encode():
        raise MalformedEvent(f"key {key!r} differs from rollout_id {message.rollout_id!r}")
    raw = value if kind == "rollout" else None
    return Event(kind, message.event_id, message.rollout_id, message.client_ts_ms, message, handle, caught_up, raw)
