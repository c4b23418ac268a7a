"""Which arm of the A/B test serves a user: a stable hash, the same in every worker."""

from __future__ import annotations

import hashlib

from rtrl.v1 import common_pb2

ARM_ENUM = {"control": common_pb2.ARM_CONTROL, "treatment": common_pb2.ARM_TREATMENT}


def assign_arm(user_id: str, treatment_fraction: float) -> str:
    """ "treatment" for a fixed ``treatment_fraction`` of user ids, "control" otherwise.

    sha256 rather than hash(): Python salts str hashes per process, and every worker
    must put a user in the same arm for the whole experiment."""
    if not 0.0 <= treatment_fraction <= 1.0:
        raise ValueError(f"treatment_fraction must be in [0, 1], got {treatment_fraction}")
    point = int.from_bytes(hashlib.sha256(user_id.encode()).digest()[:8], "big") / 2**64
    return "treatment" if point < treatment_fraction else "control"
