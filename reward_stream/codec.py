"""Kafka record -> join Event, with the checks that decide what goes to the DLQ."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeGuard

from google.protobuf.message import DecodeError

from rtrl import topics
from rtrl.reward_stream.join import TELEMETRY_KINDS, Event, EventKind, TelemetryKind
from rtrl.v1 import rollout_pb2
from rtrl_client.v1 import telemetry_pb2


class MalformedEvent(ValueError):
    """The record cannot be joined; str(exc) is the reason put in the DLQ header."""


class Unauthenticated(MalformedEvent):
    """A record its topic's writer did not sign (forged, tampered or unsigned): a rollout
    no inference worker signed, an event the ingest gateway did not authenticate."""


class PrivacyModeEvent(Exception):
    """An event from a user in privacy mode that should never have reached a topic.

    It is dropped, not dead-lettered: the DLQ is a topic too.
    """


def decode(
    topic: str,
    key: bytes | None,
    value: bytes | None,
    handle: object = None,
    caught_up: bool = True,
) -> Event:
    if not value:
        raise MalformedEvent("empty value")
    message: rollout_pb2.RolloutRecord | telemetry_pb2.TelemetryEvent
    kind: EventKind
    try:
        if topic == topics.ROLLOUT:
            message = rollout_pb2.RolloutRecord.FromString(value)
            kind = "rollout"
        else:
            message = telemetry_pb2.TelemetryEvent.FromString(value)
            kind = _telemetry_kind(message, topic)
    except DecodeError as exc:
        raise MalformedEvent(f"protobuf decode failed: {exc}") from exc
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
    raw, link = None, None
    if isinstance(message, rollout_pb2.RolloutRecord):
        raw = value
        if message.HasField("link"):
            link = (message.link.position, message.link.final)
    return Event(
        kind,
        message.event_id,
        message.rollout_id,
        message.client_ts_ms,
        message,
        handle,
        caught_up,
        raw,
        link,
        client_id=message.client_id,
        size=len(value),
    )


# The join carries an Event's message without looking inside (Event.message is an
# object); what builds rewards from its outputs takes the messages back out typed.


def message_of(event: Event) -> rollout_pb2.RolloutRecord | telemetry_pb2.TelemetryEvent:
    """The protobuf decode() put in ``event``."""
    message = event.message
    if not isinstance(message, (rollout_pb2.RolloutRecord, telemetry_pb2.TelemetryEvent)):
        raise TypeError(
            f"event {event.event_id} holds no decoded record but a {type(message).__name__}"
        )
    return message


def rollout_of(event: Event) -> rollout_pb2.RolloutRecord:
    """The RolloutRecord of a "rollout" event."""
    message = event.message
    if not isinstance(message, rollout_pb2.RolloutRecord):
        raise TypeError(f"event {event.event_id} of kind {event.kind} holds no RolloutRecord")
    return message


def telemetry_of(events: Iterable[Event]) -> list[telemetry_pb2.TelemetryEvent]:
    """The TelemetryEvents of telemetry events (a Settled's ``events``), in order."""
    messages: list[telemetry_pb2.TelemetryEvent] = []
    for event in events:
        message = event.message
        if not isinstance(message, telemetry_pb2.TelemetryEvent):
            raise TypeError(f"event {event.event_id} of kind {event.kind} holds no TelemetryEvent")
        messages.append(message)
    return messages


def _telemetry_kind(message: telemetry_pb2.TelemetryEvent, topic: str) -> TelemetryKind:
    """The event kind of a TelemetryEvent read from ``topic``: its payload case, which
    must be one that belongs on that topic, from a user not in privacy mode."""
    payload = message.WhichOneof("payload")
    if payload is None:
        raise MalformedEvent("TelemetryEvent without payload")
    if not _is_telemetry_kind(payload) or topics.BY_PAYLOAD.get(payload) != topic:
        raise MalformedEvent(f"payload {payload} does not belong on {topic}")
    if message.privacy_mode:
        raise PrivacyModeEvent(message.event_id)
    return payload


def _is_telemetry_kind(payload: str) -> TypeGuard[TelemetryKind]:
    return payload in TELEMETRY_KINDS
