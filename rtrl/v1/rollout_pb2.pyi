from rtrl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VersionSpan(_message.Message):
    __slots__ = ("policy_version", "start", "end")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    start: int
    end: int
    def __init__(self, policy_version: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "max_tokens", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    max_tokens: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., max_tokens: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("name", "arguments_json", "valid", "error", "id", "turn")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    VALID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    name: str
    arguments_json: str
    valid: bool
    error: str
    id: str
    turn: int
    def __init__(self, name: _Optional[str] = ..., arguments_json: _Optional[str] = ..., valid: _Optional[bool] = ..., error: _Optional[str] = ..., id: _Optional[str] = ..., turn: _Optional[int] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("kind", "token_ids", "logprobs", "version_spans", "source")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[Segment.Kind]
        KIND_GENERATED: _ClassVar[Segment.Kind]
        KIND_OBSERVED: _ClassVar[Segment.Kind]
    KIND_UNSPECIFIED: Segment.Kind
    KIND_GENERATED: Segment.Kind
    KIND_OBSERVED: Segment.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    VERSION_SPANS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    kind: Segment.Kind
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    version_spans: _containers.RepeatedCompositeFieldContainer[VersionSpan]
    source: str
    def __init__(self, kind: _Optional[_Union[Segment.Kind, str]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., version_spans: _Optional[_Iterable[_Union[VersionSpan, _Mapping]]] = ..., source: _Optional[str] = ...) -> None: ...

class TrajectoryLink(_message.Message):
    __slots__ = ("trajectory_id", "position", "final", "reason")
    class Reason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        REASON_UNSPECIFIED: _ClassVar[TrajectoryLink.Reason]
        REASON_FIRST: _ClassVar[TrajectoryLink.Reason]
        REASON_NOT_AN_EXTENSION: _ClassVar[TrajectoryLink.Reason]
    REASON_UNSPECIFIED: TrajectoryLink.Reason
    REASON_FIRST: TrajectoryLink.Reason
    REASON_NOT_AN_EXTENSION: TrajectoryLink.Reason
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    position: int
    final: bool
    reason: TrajectoryLink.Reason
    def __init__(self, trajectory_id: _Optional[str] = ..., position: _Optional[int] = ..., final: _Optional[bool] = ..., reason: _Optional[_Union[TrajectoryLink.Reason, str]] = ...) -> None: ...

class RouterChoices(_message.Message):
    __slots__ = ("layers", "top_k", "num_experts", "expert_ids")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_IDS_FIELD_NUMBER: _ClassVar[int]
    layers: int
    top_k: int
    num_experts: int
    expert_ids: bytes
    def __init__(self, layers: _Optional[int] = ..., top_k: _Optional[int] = ..., num_experts: _Optional[int] = ..., expert_ids: _Optional[bytes] = ...) -> None: ...

class VersionTokens(_message.Message):
    __slots__ = ("policy_version", "tokens")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    tokens: int
    def __init__(self, policy_version: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class ToolCounts(_message.Message):
    __slots__ = ("name", "calls", "invalid")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    INVALID_FIELD_NUMBER: _ClassVar[int]
    name: str
    calls: int
    invalid: int
    def __init__(self, name: _Optional[str] = ..., calls: _Optional[int] = ..., invalid: _Optional[int] = ...) -> None: ...

class Bulk(_message.Message):
    __slots__ = ("checksum", "size", "prompt_tokens", "generated_tokens", "observed_tokens", "turns", "version_tokens", "tool_calls", "parallel_turns")
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    VERSION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TURNS_FIELD_NUMBER: _ClassVar[int]
    checksum: str
    size: int
    prompt_tokens: int
    generated_tokens: int
    observed_tokens: int
    turns: int
    version_tokens: _containers.RepeatedCompositeFieldContainer[VersionTokens]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCounts]
    parallel_turns: int
    def __init__(self, checksum: _Optional[str] = ..., size: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., observed_tokens: _Optional[int] = ..., turns: _Optional[int] = ..., version_tokens: _Optional[_Iterable[_Union[VersionTokens, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCounts, _Mapping]]] = ..., parallel_turns: _Optional[int] = ...) -> None: ...

class RolloutRecord(_message.Message):
    __slots__ = ("event_id", "rollout_id", "session_id", "client_ts_ms", "schema_version", "user_id", "worker_id", "arm", "model_name", "prompt_group_id", "prompt_token_ids", "completion_token_ids", "completion_logprobs", "version_spans", "sampling", "latency_s", "time_to_first_token_s", "tool_calls", "prompt_text", "completion_text", "finish_reason", "traceparent", "client_id", "router_choices", "context_key", "segments", "link", "bulk", "wall_s")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_TS_MS_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ARM_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    PROMPT_GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    VERSION_SPANS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTER_CHOICES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_KEY_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    LINK_FIELD_NUMBER: _ClassVar[int]
    BULK_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    rollout_id: str
    session_id: str
    client_ts_ms: int
    schema_version: int
    user_id: str
    worker_id: str
    arm: _common_pb2.Arm
    model_name: str
    prompt_group_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_logprobs: _containers.RepeatedScalarFieldContainer[float]
    version_spans: _containers.RepeatedCompositeFieldContainer[VersionSpan]
    sampling: SamplingParams
    latency_s: float
    time_to_first_token_s: float
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    prompt_text: str
    completion_text: str
    finish_reason: str
    traceparent: str
    client_id: str
    router_choices: RouterChoices
    context_key: str
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    link: TrajectoryLink
    bulk: Bulk
    wall_s: float
    def __init__(self, event_id: _Optional[str] = ..., rollout_id: _Optional[str] = ..., session_id: _Optional[str] = ..., client_ts_ms: _Optional[int] = ..., schema_version: _Optional[int] = ..., user_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., arm: _Optional[_Union[_common_pb2.Arm, str]] = ..., model_name: _Optional[str] = ..., prompt_group_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., completion_token_ids: _Optional[_Iterable[int]] = ..., completion_logprobs: _Optional[_Iterable[float]] = ..., version_spans: _Optional[_Iterable[_Union[VersionSpan, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., latency_s: _Optional[float] = ..., time_to_first_token_s: _Optional[float] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., prompt_text: _Optional[str] = ..., completion_text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., traceparent: _Optional[str] = ..., client_id: _Optional[str] = ..., router_choices: _Optional[_Union[RouterChoices, _Mapping]] = ..., context_key: _Optional[str] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., link: _Optional[_Union[TrajectoryLink, _Mapping]] = ..., bulk: _Optional[_Union[Bulk, _Mapping]] = ..., wall_s: _Optional[float] = ...) -> None: ...
