from rtrl_client.v1 import telemetry_pb2 as _telemetry_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PublishEventsRequest(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[_telemetry_pb2.TelemetryEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[_telemetry_pb2.TelemetryEvent, _Mapping]]] = ...) -> None: ...

class EventResult(_message.Message):
    __slots__ = ("event_id", "status", "field", "error")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATUS_UNSPECIFIED: _ClassVar[EventResult.Status]
        STATUS_ACCEPTED: _ClassVar[EventResult.Status]
        STATUS_DUPLICATE: _ClassVar[EventResult.Status]
        STATUS_REJECTED: _ClassVar[EventResult.Status]
        STATUS_RETRY: _ClassVar[EventResult.Status]
    STATUS_UNSPECIFIED: EventResult.Status
    STATUS_ACCEPTED: EventResult.Status
    STATUS_DUPLICATE: EventResult.Status
    STATUS_REJECTED: EventResult.Status
    STATUS_RETRY: EventResult.Status
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    status: EventResult.Status
    field: str
    error: str
    def __init__(self, event_id: _Optional[str] = ..., status: _Optional[_Union[EventResult.Status, str]] = ..., field: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class PublishEventsResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[EventResult]
    def __init__(self, results: _Optional[_Iterable[_Union[EventResult, _Mapping]]] = ...) -> None: ...
