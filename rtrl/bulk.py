"""A rollout record's bulk, out of band: what makes a long trajectory long travels
through the rollout blob store, not through Kafka.

An agent's trajectory of 32k tokens is a record of several hundred kilobytes, and a
mixture-of-experts rollout carries its routes: records over the broker's limit, which
the joiner would also hold for its whole window and copy into the reward. A record over
the worker's inline limit (RTRL_INFERENCE_ROLLOUT_INLINE_BYTES) is therefore split:

* its bulk (BULK_FIELDS: the prompt and generated tokens, log-probs, version spans,
  segments, tool calls with their arguments, prompt text, router choices) is written to
  the store as a RolloutRecord of those fields alone, named by the SHA-256 of its bytes;
* the record that travels keeps everything else and a ``Bulk`` with the checksum and
  the counts that the joiner, its monitors and the analytics sink read (tokens per
  version, tool calls per name: trajectory_summary.Summary reads them from it), so none
  of them fetches the bulk and a pending rollout costs the joiner about the same at any
  length.

The trainer inflates the record (inflate) before it reads the trajectory. The checksum is
inside the record, so the worker's signature, the joiner's MAC and the reward's MAC cover
it: a blob that hashes to it is the one the worker wrote, and one that does not (or is
gone) is refused, never trained on. A record names no location, only a checksum: each
process reads its own configured store, so a record cannot point a reader elsewhere.

This module moves the fields without reading them; rtrl/trajectory.py stays the one
reader of what they hold.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from google.protobuf.message import DecodeError

from rtrl.durable import write_durably
from rtrl.trajectory_summary import Summary
from rtrl.v1 import rollout_pb2

BULK_FIELDS = frozenset(
    {
        "prompt_token_ids",
        "completion_token_ids",
        "completion_logprobs",
        "version_spans",
        "segments",
        "tool_calls",
        "prompt_text",
        "router_choices",
    }
)
"""The RolloutRecord fields that go out of band."""

_CHECKSUM = re.compile(r"sha256:([0-9a-f]{64})")


class BulkUnavailable(Exception):
    """The record's bulk is not in the store (never written here, or removed)."""


class BulkCorrupt(ValueError):
    """The store's blob is not the bulk the record names: another size or checksum, or
    not a bulk at all. Never trained on."""


def checksum_of(blob: bytes) -> str:
    return "sha256:" + hashlib.sha256(blob).hexdigest()


class BulkStore:
    """Bulk blobs in a local directory (a shared volume on a cluster), each at
    ``<root>/<2 hex digits>/<64 hex digits>``, written durably and never rewritten: a
    name is its content's hash, so writing one again is a no-op."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()

    def path(self, checksum: str) -> Path:
        """Where the blob of ``checksum`` lies; BulkCorrupt for anything but a checksum."""
        matched = _CHECKSUM.fullmatch(checksum)
        if matched is None:
            raise BulkCorrupt(f"{checksum!r} is not sha256: and 64 lowercase hex digits")
        digest = matched.group(1)
        return self.root / digest[:2] / digest

    def put(self, blob: bytes) -> str:
        """Store ``blob`` durably; its checksum."""
        checksum = checksum_of(blob)
        path = self.path(checksum)
        if not path.is_file():
            write_durably(path, blob)
        return checksum

    def get(self, checksum: str, size: int) -> bytes:
        """The blob of ``checksum``, as stored, when it is the ``size`` bytes the record
        names (inflate verifies its checksum). The size is checked before anything is
        read, and nothing past it is read: a larger file at that name (planted, or not a
        bulk) costs a stat, not its size in memory. BulkCorrupt for another size."""
        path = self.path(checksum)
        try:
            with path.open("rb") as f:
                stored = os.fstat(f.fileno()).st_size
                if stored != size:
                    raise BulkCorrupt(
                        f"the stored bulk {checksum} is {stored:,} bytes, not the {size:,} named"
                    )
                blob = f.read(size + 1)
        except FileNotFoundError:
            raise BulkUnavailable(f"no rollout bulk {checksum} in {self.root}") from None
        if len(blob) != size:
            raise BulkCorrupt(f"the stored bulk {checksum} changed size while it was read")
        return blob


def split(record: rollout_pb2.RolloutRecord) -> tuple[rollout_pb2.RolloutRecord, bytes]:
    """(the record that travels, its bulk blob). The record names the blob by checksum
    and keeps the counts Summary reads; ``record`` is left as it is."""
    bulk = rollout_pb2.RolloutRecord()
    bulk.CopyFrom(record)
    for field, _ in bulk.ListFields():
        if field.name not in BULK_FIELDS:
            bulk.ClearField(field.name)
    blob = bulk.SerializeToString()
    summary = Summary.of(record)
    slim = rollout_pb2.RolloutRecord()
    slim.CopyFrom(record)
    for name in BULK_FIELDS:
        slim.ClearField(name)
    slim.bulk.CopyFrom(
        rollout_pb2.Bulk(
            checksum=checksum_of(blob),
            size=len(blob),
            prompt_tokens=summary.prompt_tokens,
            generated_tokens=summary.generated_tokens,
            observed_tokens=summary.observed_tokens,
            turns=summary.turns,
            version_tokens=[
                rollout_pb2.VersionTokens(policy_version=version, tokens=tokens)
                for version, tokens in summary.version_tokens
            ],
            tool_calls=[
                rollout_pb2.ToolCounts(name=c.name, calls=c.calls, invalid=c.invalid)
                for c in summary.tool_counts
            ],
            parallel_turns=summary.parallel_turns,
        )
    )
    return slim, blob


def inflate(record: rollout_pb2.RolloutRecord, store: BulkStore) -> rollout_pb2.RolloutRecord:
    """The whole record: ``record`` itself when nothing went out of band, else a copy with
    its bulk read back from ``store`` and checked against the checksum it names. Raises
    BulkUnavailable (not in the store) or BulkCorrupt (not the bulk named)."""
    if not record.HasField("bulk"):
        return record
    inline = sorted(f.name for f, _ in record.ListFields() if f.name in BULK_FIELDS)
    if inline:
        raise BulkCorrupt(
            f"rollout {record.rollout_id} names a bulk and holds {', '.join(inline)} inline too"
        )
    named = record.bulk
    try:
        blob = store.get(named.checksum, named.size)
    except BulkCorrupt as exc:
        raise BulkCorrupt(f"rollout {record.rollout_id}: {exc}") from None
    if len(blob) != named.size or checksum_of(blob) != named.checksum:
        raise BulkCorrupt(
            f"rollout {record.rollout_id}: the stored bulk is {len(blob):,} bytes hashing to "
            f"{checksum_of(blob)}, not the {named.size:,} bytes of {named.checksum} it names"
        )
    try:
        bulk = rollout_pb2.RolloutRecord.FromString(blob)
    except DecodeError as exc:
        raise BulkCorrupt(f"rollout {record.rollout_id}: its bulk does not decode: {exc}") from None
    stray = sorted(f.name for f, _ in bulk.ListFields() if f.name not in BULK_FIELDS)
    if stray:
        raise BulkCorrupt(f"rollout {record.rollout_id}: its bulk sets {', '.join(stray)}")
    whole = rollout_pb2.RolloutRecord()
    whole.CopyFrom(record)
    whole.ClearField("bulk")
    whole.MergeFrom(bulk)
    return whole
