from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from typing import ClassVar as _ClassVar

DESCRIPTOR: _descriptor.FileDescriptor

class Arm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ARM_UNSPECIFIED: _ClassVar[Arm]
    ARM_CONTROL: _ClassVar[Arm]
    ARM_TREATMENT: _ClassVar[Arm]
ARM_UNSPECIFIED: Arm
ARM_CONTROL: Arm
ARM_TREATMENT: Arm
