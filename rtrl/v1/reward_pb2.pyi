from rtrl.v1 import rollout_pb2 as _rollout_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RewardComponents(_message.Message):
    __slots__ = ("persisted_fraction", "persistence_observed", "dissatisfied", "followup_observed", "tool_call_validity", "effort_penalty", "latency_s")
    PERSISTED_FRACTION_FIELD_NUMBER: _ClassVar[int]
    PERSISTENCE_OBSERVED_FIELD_NUMBER: _ClassVar[int]
    DISSATISFIED_FIELD_NUMBER: _ClassVar[int]
    FOLLOWUP_OBSERVED_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_VALIDITY_FIELD_NUMBER: _ClassVar[int]
    EFFORT_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    persisted_fraction: float
    persistence_observed: bool
    dissatisfied: float
    followup_observed: bool
    tool_call_validity: float
    effort_penalty: float
    latency_s: float
    def __init__(self, persisted_fraction: _Optional[float] = ..., persistence_observed: _Optional[bool] = ..., dissatisfied: _Optional[float] = ..., followup_observed: _Optional[bool] = ..., tool_call_validity: _Optional[float] = ..., effort_penalty: _Optional[float] = ..., latency_s: _Optional[float] = ...) -> None: ...

class RewardRecord(_message.Message):
    __slots__ = ("reward_id", "rollout_id", "rollout", "components", "reward", "reward_fn_version", "defaulted", "last_event_ts_ms", "settled_ts_ms", "event_ids", "traceparent", "discarded")
    REWARD_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_FN_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEFAULTED_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_TS_MS_FIELD_NUMBER: _ClassVar[int]
    SETTLED_TS_MS_FIELD_NUMBER: _ClassVar[int]
    EVENT_IDS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_FIELD_NUMBER: _ClassVar[int]
    reward_id: str
    rollout_id: str
    rollout: _rollout_pb2.RolloutRecord
    components: RewardComponents
    reward: float
    reward_fn_version: str
    defaulted: bool
    last_event_ts_ms: int
    settled_ts_ms: int
    event_ids: _containers.RepeatedScalarFieldContainer[str]
    traceparent: str
    discarded: bool
    def __init__(self, reward_id: _Optional[str] = ..., rollout_id: _Optional[str] = ..., rollout: _Optional[_Union[_rollout_pb2.RolloutRecord, _Mapping]] = ..., components: _Optional[_Union[RewardComponents, _Mapping]] = ..., reward: _Optional[float] = ..., reward_fn_version: _Optional[str] = ..., defaulted: _Optional[bool] = ..., last_event_ts_ms: _Optional[int] = ..., settled_ts_ms: _Optional[int] = ..., event_ids: _Optional[_Iterable[str]] = ..., traceparent: _Optional[str] = ..., discarded: _Optional[bool] = ...) -> None: ...
