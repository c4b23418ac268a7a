"""A reward record's identity and its bytes on the wire.

``reward_id``: the same rollout, events and reward function always give the same id, so a
reward re-emitted after a crash is the same reward (the trainer and the analytics sink
dedup by it). ``encode_with_rollout``: a reward with its rollout's original bytes spliced in.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence

from rtrl.v1 import reward_pb2

# Fixed namespace so reward ids are stable across processes and releases.
REWARD_ID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://rtrl/reward_id")
_NAMESPACE_BYTES = REWARD_ID_NAMESPACE.bytes


def reward_id(rollout_id: str, event_ids: Sequence[str], version: str) -> str:
    """Same rollout, same contributing events, same reward function => same id.

    The RFC 4122 version-5 UUID of the name in REWARD_ID_NAMESPACE, exactly as
    ``str(uuid.uuid5(...))`` gives it, without building a UUID object (a third of
    the cost of a reward record on the joiner's hot path)."""
    name = "\x1f".join((version, rollout_id, *sorted(event_ids)))
    digest = bytearray(hashlib.sha1(_NAMESPACE_BYTES + name.encode()).digest()[:16])
    digest[6] = (digest[6] & 0x0F) | 0x50  # version 5
    digest[8] = (digest[8] & 0x3F) | 0x80  # RFC 4122 variant
    h = digest.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


_ROLLOUT_KEY = bytes([reward_pb2.RewardRecord.ROLLOUT_FIELD_NUMBER << 3 | 2])  # length-delimited


def encode_with_rollout(record: reward_pb2.RewardRecord, rollout_bytes: bytes) -> bytes:
    """``record`` (built with_rollout=False) serialized with ``rollout_bytes`` as its rollout.

    The same message as setting the field and serializing, since a protobuf parser
    accepts fields in any order, but without copying the rollout (its token ids and
    log-probs are most of a reward's bytes) and encoding it again: on the joiner's hot
    path that was a fifth of a reward's cost. The rollout also keeps exactly the bytes
    the inference worker wrote, fields this version does not know included."""
    if record.HasField("rollout"):
        raise ValueError("record already holds a rollout; build it with with_rollout=False")
    return b"".join(
        (record.SerializeToString(), _ROLLOUT_KEY, _varint(len(rollout_bytes)), rollout_bytes)
    )


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)
