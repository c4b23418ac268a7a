from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EditShown(_message.Message):
    __slots__ = ("file_path", "edit_text")
    FILE_PATH_FIELD_NUMBER: _ClassVar[int]
    EDIT_TEXT_FIELD_NUMBER: _ClassVar[int]
    file_path: str
    edit_text: str
    def __init__(self, file_path: _Optional[str] = ..., edit_text: _Optional[str] = ...) -> None: ...

class EditOutcome(_message.Message):
    __slots__ = ("outcome",)
    class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OUTCOME_UNSPECIFIED: _ClassVar[EditOutcome.Outcome]
        OUTCOME_ACCEPTED: _ClassVar[EditOutcome.Outcome]
        OUTCOME_REJECTED: _ClassVar[EditOutcome.Outcome]
    OUTCOME_UNSPECIFIED: EditOutcome.Outcome
    OUTCOME_ACCEPTED: EditOutcome.Outcome
    OUTCOME_REJECTED: EditOutcome.Outcome
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    outcome: EditOutcome.Outcome
    def __init__(self, outcome: _Optional[_Union[EditOutcome.Outcome, str]] = ...) -> None: ...

class PersistenceSnapshot(_message.Message):
    __slots__ = ("seconds_after_edit", "region_text")
    SECONDS_AFTER_EDIT_FIELD_NUMBER: _ClassVar[int]
    REGION_TEXT_FIELD_NUMBER: _ClassVar[int]
    seconds_after_edit: float
    region_text: str
    def __init__(self, seconds_after_edit: _Optional[float] = ..., region_text: _Optional[str] = ...) -> None: ...

class FollowUp(_message.Message):
    __slots__ = ("seconds_after_edit", "message")
    SECONDS_AFTER_EDIT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    seconds_after_edit: float
    message: str
    def __init__(self, seconds_after_edit: _Optional[float] = ..., message: _Optional[str] = ...) -> None: ...

class TelemetryEvent(_message.Message):
    __slots__ = ("event_id", "rollout_id", "session_id", "client_ts_ms", "schema_version", "user_id", "privacy_mode", "client_id", "edit_shown", "edit_outcome", "persistence", "followup")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_TS_MS_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    PRIVACY_MODE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    EDIT_SHOWN_FIELD_NUMBER: _ClassVar[int]
    EDIT_OUTCOME_FIELD_NUMBER: _ClassVar[int]
    PERSISTENCE_FIELD_NUMBER: _ClassVar[int]
    FOLLOWUP_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    rollout_id: str
    session_id: str
    client_ts_ms: int
    schema_version: int
    user_id: str
    privacy_mode: bool
    client_id: str
    edit_shown: EditShown
    edit_outcome: EditOutcome
    persistence: PersistenceSnapshot
    followup: FollowUp
    def __init__(self, event_id: _Optional[str] = ..., rollout_id: _Optional[str] = ..., session_id: _Optional[str] = ..., client_ts_ms: _Optional[int] = ..., schema_version: _Optional[int] = ..., user_id: _Optional[str] = ..., privacy_mode: _Optional[bool] = ..., client_id: _Optional[str] = ..., edit_shown: _Optional[_Union[EditShown, _Mapping]] = ..., edit_outcome: _Optional[_Union[EditOutcome, _Mapping]] = ..., persistence: _Optional[_Union[PersistenceSnapshot, _Mapping]] = ..., followup: _Optional[_Union[FollowUp, _Mapping]] = ...) -> None: ...
