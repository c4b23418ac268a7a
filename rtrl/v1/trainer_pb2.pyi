from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StalenessBucket(_message.Message):
    __slots__ = ("staleness", "rollouts")
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    staleness: int
    rollouts: int
    def __init__(self, staleness: _Optional[int] = ..., rollouts: _Optional[int] = ...) -> None: ...

class TokenStaleness(_message.Message):
    __slots__ = ("staleness", "tokens")
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    staleness: int
    tokens: int
    def __init__(self, staleness: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class TrainerStep(_message.Message):
    __slots__ = ("step_id", "lineage", "step", "base_version", "version", "published", "ts_ms", "rollouts", "tokens", "reward_mean", "loss", "kl", "entropy", "clipped_fraction", "ratio_mean", "grad_norm", "advantage_abs_mean", "staleness", "dropped", "eval_candidate", "eval_published", "eval_regressions", "batch_wait_s", "step_s", "eval_s", "publish_s", "traceparent", "trained_through_event_ts_ms", "newest_reward_ts_ms", "newest_read_ts_ms", "started_ts_ms", "optimizer_steps", "gate_wait_s", "mismatch_mean", "mismatch_max", "mismatch_over_threshold_share", "mismatch_tokens", "mismatch_threshold", "token_staleness")
    class DroppedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class EvalCandidateEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class EvalPublishedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    TS_MS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    KL_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    CLIPPED_FRACTION_FIELD_NUMBER: _ClassVar[int]
    RATIO_MEAN_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_ABS_MEAN_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    EVAL_CANDIDATE_FIELD_NUMBER: _ClassVar[int]
    EVAL_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    EVAL_REGRESSIONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    EVAL_S_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_S_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRAINED_THROUGH_EVENT_TS_MS_FIELD_NUMBER: _ClassVar[int]
    NEWEST_REWARD_TS_MS_FIELD_NUMBER: _ClassVar[int]
    NEWEST_READ_TS_MS_FIELD_NUMBER: _ClassVar[int]
    STARTED_TS_MS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STEPS_FIELD_NUMBER: _ClassVar[int]
    GATE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    MISMATCH_MEAN_FIELD_NUMBER: _ClassVar[int]
    MISMATCH_MAX_FIELD_NUMBER: _ClassVar[int]
    MISMATCH_OVER_THRESHOLD_SHARE_FIELD_NUMBER: _ClassVar[int]
    MISMATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MISMATCH_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STALENESS_FIELD_NUMBER: _ClassVar[int]
    step_id: str
    lineage: str
    step: int
    base_version: int
    version: int
    published: bool
    ts_ms: int
    rollouts: int
    tokens: int
    reward_mean: float
    loss: float
    kl: float
    entropy: float
    clipped_fraction: float
    ratio_mean: float
    grad_norm: float
    advantage_abs_mean: float
    staleness: _containers.RepeatedCompositeFieldContainer[StalenessBucket]
    dropped: _containers.ScalarMap[str, int]
    eval_candidate: _containers.ScalarMap[str, float]
    eval_published: _containers.ScalarMap[str, float]
    eval_regressions: _containers.RepeatedScalarFieldContainer[str]
    batch_wait_s: float
    step_s: float
    eval_s: float
    publish_s: float
    traceparent: str
    trained_through_event_ts_ms: int
    newest_reward_ts_ms: int
    newest_read_ts_ms: int
    started_ts_ms: int
    optimizer_steps: int
    gate_wait_s: float
    mismatch_mean: float
    mismatch_max: float
    mismatch_over_threshold_share: float
    mismatch_tokens: int
    mismatch_threshold: float
    token_staleness: _containers.RepeatedCompositeFieldContainer[TokenStaleness]
    def __init__(self, step_id: _Optional[str] = ..., lineage: _Optional[str] = ..., step: _Optional[int] = ..., base_version: _Optional[int] = ..., version: _Optional[int] = ..., published: _Optional[bool] = ..., ts_ms: _Optional[int] = ..., rollouts: _Optional[int] = ..., tokens: _Optional[int] = ..., reward_mean: _Optional[float] = ..., loss: _Optional[float] = ..., kl: _Optional[float] = ..., entropy: _Optional[float] = ..., clipped_fraction: _Optional[float] = ..., ratio_mean: _Optional[float] = ..., grad_norm: _Optional[float] = ..., advantage_abs_mean: _Optional[float] = ..., staleness: _Optional[_Iterable[_Union[StalenessBucket, _Mapping]]] = ..., dropped: _Optional[_Mapping[str, int]] = ..., eval_candidate: _Optional[_Mapping[str, float]] = ..., eval_published: _Optional[_Mapping[str, float]] = ..., eval_regressions: _Optional[_Iterable[str]] = ..., batch_wait_s: _Optional[float] = ..., step_s: _Optional[float] = ..., eval_s: _Optional[float] = ..., publish_s: _Optional[float] = ..., traceparent: _Optional[str] = ..., trained_through_event_ts_ms: _Optional[int] = ..., newest_reward_ts_ms: _Optional[int] = ..., newest_read_ts_ms: _Optional[int] = ..., started_ts_ms: _Optional[int] = ..., optimizer_steps: _Optional[int] = ..., gate_wait_s: _Optional[float] = ..., mismatch_mean: _Optional[float] = ..., mismatch_max: _Optional[float] = ..., mismatch_over_threshold_share: _Optional[float] = ..., mismatch_tokens: _Optional[int] = ..., mismatch_threshold: _Optional[float] = ..., token_staleness: _Optional[_Iterable[_Union[TokenStaleness, _Mapping]]] = ...) -> None: ...
