"""The SDK's on-disk spool: events are durable here until the gateway has answered them.

Spool layout (one process per directory, enforced with ``flock`` on ``LOCK``):
  ``<n>.seg``   records ``u32 length | u32 crc32 | serialized TelemetryEvent``, appended only
  ``<n>.acks``  ``u64`` offsets of that segment's records that got a final answer
A segment is deleted once every record in it is answered. A record torn by a crash
mid-append fails its length or CRC check and is cut off at the next start: its
``append`` never returned, so nobody was promised it.
"""

from __future__ import annotations

import collections
import fcntl
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("rtrl_client")

_RECORD_HEADER = struct.Struct(">II")
_ACK = struct.Struct(">Q")


class SpoolFull(RuntimeError):
    """The spool holds max_spool_bytes of undelivered events: the event was not recorded.
    The gateway has been unreachable (or refusing the key) for a long time."""


class SpoolLocked(RuntimeError):
    """Another process uses this spool directory; two senders would resend each other's events."""


@dataclass(frozen=True)
class SpooledEvent:
    """Produced by Spool.oldest; consumed by the sender, which acks it by ``seq``."""

    seq: int
    payload: bytes
    """A serialized TelemetryEvent."""
    spooled_at: float
    """time.monotonic() of the append (of the start, for records found on disk)."""


@dataclass(eq=False)
class _Segment:
    number: int
    directory: Path
    size: int = 0
    acks_size: int = 0
    unanswered: int = 0

    @property
    def path(self) -> Path:
        return self.directory / f"{self.number:016d}.seg"

    @property
    def acks_path(self) -> Path:
        return self.directory / f"{self.number:016d}.acks"


@dataclass(frozen=True)
class _Slot:
    segment: _Segment
    offset: int
    payload: bytes
    spooled_at: float


class Spool:
    """Length-prefixed, CRC-checked records in append-only segment files, bounded in bytes.
    Thread-safe: product threads append while the sender reads and acks."""

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_bytes: int,
        segment_bytes: int,
        fsync: bool = True,
    ) -> None:
        self.directory = Path(directory)
        # Events hold users' code and messages: the spool is its owner's alone.
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.directory.chmod(0o700)
        self._max_bytes = max_bytes
        self._segment_bytes = segment_bytes
        self._fsync = fsync
        self._lock = threading.Lock()
        self._lock_file = os.fdopen(
            os.open(self.directory / "LOCK", os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600), "a+b"
        )
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise SpoolLocked(f"spool {self.directory} is in use by another process") from None
        self._unanswered: collections.OrderedDict[int, _Slot] = collections.OrderedDict()
        self._next_seq = 0
        self._bytes = 0
        self._active: _Segment | None = None
        self._active_fd: int | None = None
        self._next_segment = 1
        self._load()

    # -- product threads --

    def append(self, payloads: Sequence[bytes]) -> list[int]:
        """Record payloads durably (one write, one fsync); their sequence numbers, in order."""
        if not payloads:
            return []
        frames = [_RECORD_HEADER.pack(len(p), zlib.crc32(p)) + p for p in payloads]
        size = sum(len(f) for f in frames)
        with self._lock:
            if self._lock_file.closed:
                raise RuntimeError(f"spool {self.directory} is closed")
            if self._bytes + size > self._max_bytes:
                raise SpoolFull(
                    f"spool {self.directory} holds {self._bytes} bytes of undelivered events "
                    f"({len(self._unanswered)} events); "
                    f"{size} more would pass max_spool_bytes={self._max_bytes}"
                )
            segment, fd = self._segment_for(size)
            try:
                data = memoryview(b"".join(frames))
                while data:
                    data = data[os.write(fd, data) :]
                if self._fsync:
                    os.fsync(fd)
            except BaseException:
                # A partial record would hide every record appended after it at the next start.
                os.ftruncate(fd, segment.size)
                raise
            now = time.monotonic()
            seqs = []
            offset = segment.size
            for frame, payload in zip(frames, payloads, strict=True):
                self._unanswered[self._next_seq] = _Slot(segment, offset, payload, now)
                seqs.append(self._next_seq)
                self._next_seq += 1
                offset += len(frame)
            segment.size += size
            segment.unanswered += len(frames)
            self._bytes += size
            return seqs

    # -- the sender --

    def oldest_spooled_at(self) -> float | None:
        with self._lock:
            return next(iter(self._unanswered.values())).spooled_at if self._unanswered else None

    def oldest(self, limit: int, max_bytes: int | None = None) -> list[SpooledEvent]:
        """Up to ``limit`` unanswered events, oldest first, of at most ``max_bytes`` together
        (but always at least one)."""
        with self._lock:
            out: list[SpooledEvent] = []
            size = 0
            for seq, slot in self._unanswered.items():
                size += len(slot.payload)
                if len(out) == limit or (out and max_bytes is not None and size > max_bytes):
                    break
                out.append(SpooledEvent(seq, slot.payload, slot.spooled_at))
            return out

    def ack(self, seqs: Iterable[int]) -> None:
        """These events got a final answer: forget them, durably, and free whole segments."""
        with self._lock:
            answered: dict[_Segment, list[int]] = collections.defaultdict(list)
            for seq in seqs:
                slot = self._unanswered.pop(seq, None)
                if slot is not None:
                    answered[slot.segment].append(slot.offset)
            for segment, offsets in answered.items():
                segment.unanswered -= len(offsets)
                if segment.unanswered == 0:
                    self._drop(segment)
                else:
                    # Without this, a restart would resend the answered part of the segment
                    # (harmless, DUPLICATE) but only while the gateway still remembers it.
                    with os.fdopen(
                        os.open(segment.acks_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600),
                        "ab",
                    ) as acks:
                        acks.write(b"".join(_ACK.pack(o) for o in offsets))
                        acks.flush()
                        if self._fsync:
                            os.fsync(acks.fileno())
                    segment.acks_size += _ACK.size * len(offsets)
                    self._bytes += _ACK.size * len(offsets)

    # -- anyone --

    def __len__(self) -> int:
        return len(self._unanswered)

    @property
    def bytes(self) -> int:
        """Bytes on disk, counted against max_bytes."""
        return self._bytes

    @property
    def last_seq(self) -> int:
        """Sequence number of the latest append (-1 before any)."""
        return self._next_seq - 1

    def unanswered_through(self, seq: int) -> bool:
        """Whether any event appended at or before ``seq`` still waits for an answer."""
        with self._lock:
            return bool(self._unanswered) and next(iter(self._unanswered)) <= seq

    def close(self) -> None:
        """Release the directory. What is unanswered stays on disk for the next Spool."""
        with self._lock:
            self._close_active()
            if not self._lock_file.closed:
                self._lock_file.close()

    # -- internals, called with the lock held (or from __init__) --

    def _segment_for(self, size: int) -> tuple[_Segment, int]:
        active = self._active
        if active is not None and active.size > 0 and active.size + size > self._segment_bytes:
            self._close_active()
        if self._active is None:
            segment = _Segment(self._next_segment, self.directory)
            self._next_segment += 1
            # O_APPEND: after a failed write is truncated away, the next one lands at the new end.
            # 0o600: events carry the user's code and messages.
            self._active_fd = os.open(
                segment.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600
            )
            if self._fsync:
                _fsync_dir(self.directory)  # the new file's name must survive a power cut too
            self._active = segment
        assert self._active_fd is not None  # open exactly while a segment is active
        return self._active, self._active_fd

    def _close_active(self) -> None:
        if self._active_fd is not None:
            os.close(self._active_fd)
        self._active = self._active_fd = None

    def _drop(self, segment: _Segment) -> None:
        if segment is self._active:
            self._close_active()
        segment.path.unlink()  # first: an .acks file without its .seg is ignored at load
        segment.acks_path.unlink(missing_ok=True)
        self._bytes -= segment.size + segment.acks_size

    def _load(self) -> None:
        started = time.monotonic()
        segments = sorted(int(p.stem) for p in self.directory.glob("*.seg") if p.stem.isdigit())
        for number in segments:
            segment = _Segment(number, self.directory)
            data = segment.path.read_bytes()
            records, end = _scan(data)
            if end < len(data):
                log.warning(
                    "spool %s: cut %d bytes of a torn record at the end of %s",
                    self.directory,
                    len(data) - end,
                    segment.path.name,
                )
                with open(segment.path, "r+b") as file:
                    file.truncate(end)
                    os.fsync(file.fileno())
            answered = _read_acks(segment.acks_path)
            segment.size, segment.acks_size = end, _ACK.size * len(answered)
            for offset, payload in records:
                if offset not in answered:
                    self._unanswered[self._next_seq] = _Slot(segment, offset, payload, started)
                    self._next_seq += 1
                    segment.unanswered += 1
            self._bytes += segment.size + segment.acks_size
            if segment.unanswered == 0:
                self._drop(segment)
        for acks in self.directory.glob("*.acks"):
            if not acks.with_suffix(".seg").exists():
                acks.unlink()
        self._next_segment = (segments[-1] + 1) if segments else 1
        if self._unanswered:
            log.info(
                "spool %s: %d undelivered events from an earlier run will be resent",
                self.directory,
                len(self._unanswered),
            )


def _scan(data: bytes) -> tuple[list[tuple[int, bytes]], int]:
    """The intact records of a segment as (offset, payload), and where the intact part ends."""
    records, offset = [], 0
    while offset + _RECORD_HEADER.size <= len(data):
        length, crc = _RECORD_HEADER.unpack_from(data, offset)
        start = offset + _RECORD_HEADER.size
        end = start + length
        # length 0 also stops at a zero-filled tail, which a file system may leave after a crash.
        if length == 0 or end > len(data) or zlib.crc32(data[start:end]) != crc:
            break
        records.append((offset, data[start:end]))
        offset = end
    return records, offset


def _read_acks(path: Path) -> set[int]:
    if not path.exists():
        return set()
    data = path.read_bytes()
    whole = len(data) - len(data) % _ACK.size  # a torn last ack only means one resend
    return {offset for (offset,) in _ACK.iter_unpack(data[:whole])}


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
