from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorMeta(_message.Message):
    __slots__ = ("name", "shape", "dtype", "checksum", "encoding", "offset", "length", "changed")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    checksum: str
    encoding: str
    offset: int
    length: int
    changed: int
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., checksum: _Optional[str] = ..., encoding: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., changed: _Optional[int] = ...) -> None: ...

class Section(_message.Message):
    __slots__ = ("offset", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("arm", "version", "parent_version", "keyframe", "tensors", "blob_uri", "blob_size", "blob_checksum", "created_ts_ms", "trained_through_event_ts_ms", "rollouts_trained", "train_step", "delta_positions", "delta_values", "traceparent", "signature", "signer")
    ARM_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    KEYFRAME_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BLOB_URI_FIELD_NUMBER: _ClassVar[int]
    BLOB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOB_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    CREATED_TS_MS_FIELD_NUMBER: _ClassVar[int]
    TRAINED_THROUGH_EVENT_TS_MS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    TRAIN_STEP_FIELD_NUMBER: _ClassVar[int]
    DELTA_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    DELTA_VALUES_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    SIGNER_FIELD_NUMBER: _ClassVar[int]
    arm: str
    version: int
    parent_version: int
    keyframe: bool
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    blob_uri: str
    blob_size: int
    blob_checksum: str
    created_ts_ms: int
    trained_through_event_ts_ms: int
    rollouts_trained: int
    train_step: int
    delta_positions: Section
    delta_values: Section
    traceparent: str
    signature: bytes
    signer: str
    def __init__(self, arm: _Optional[str] = ..., version: _Optional[int] = ..., parent_version: _Optional[int] = ..., keyframe: _Optional[bool] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., blob_uri: _Optional[str] = ..., blob_size: _Optional[int] = ..., blob_checksum: _Optional[str] = ..., created_ts_ms: _Optional[int] = ..., trained_through_event_ts_ms: _Optional[int] = ..., rollouts_trained: _Optional[int] = ..., train_step: _Optional[int] = ..., delta_positions: _Optional[_Union[Section, _Mapping]] = ..., delta_values: _Optional[_Union[Section, _Mapping]] = ..., traceparent: _Optional[str] = ..., signature: _Optional[bytes] = ..., signer: _Optional[str] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("arm", "have_version", "worker_id", "follow", "resume")
    ARM_FIELD_NUMBER: _ClassVar[int]
    HAVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    arm: str
    have_version: int
    worker_id: str
    follow: bool
    resume: Resume
    def __init__(self, arm: _Optional[str] = ..., have_version: _Optional[int] = ..., worker_id: _Optional[str] = ..., follow: _Optional[bool] = ..., resume: _Optional[_Union[Resume, _Mapping]] = ...) -> None: ...

class Resume(_message.Message):
    __slots__ = ("version", "offset", "blob_checksum")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BLOB_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    version: int
    offset: int
    blob_checksum: str
    def __init__(self, version: _Optional[int] = ..., offset: _Optional[int] = ..., blob_checksum: _Optional[str] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("version", "manifest", "offset", "data", "last")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    version: int
    manifest: Manifest
    offset: int
    data: bytes
    last: bool
    def __init__(self, version: _Optional[int] = ..., manifest: _Optional[_Union[Manifest, _Mapping]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ...) -> None: ...

class PublishChunk(_message.Message):
    __slots__ = ("manifest", "data")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    manifest: Manifest
    data: bytes
    def __init__(self, manifest: _Optional[_Union[Manifest, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class LatestRequest(_message.Message):
    __slots__ = ("arm",)
    ARM_FIELD_NUMBER: _ClassVar[int]
    arm: str
    def __init__(self, arm: _Optional[str] = ...) -> None: ...

class LatestResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...
