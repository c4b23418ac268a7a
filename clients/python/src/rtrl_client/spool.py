"""The SDK's on-disk spool: events are durable here until the gateway has answered them.

Spool layout, shared with the Node SDK (clients/typescript/src/spool.ts), big-endian:
  ``<n>.seg``     records ``MARK | u32 length | u32 crc32(payload) | payload`` (a serialized
                  TelemetryEvent), appended only; ``<n>`` is 16 decimal digits
  ``<n>.acks``    ``u64`` offsets of that segment's records that got a final answer
  ``spool.lock``  the owner, as ``{"pid", "host", "started"}`` (spool_lock.py)
A segment is deleted once every record in it is answered.

What a damaged directory costs (each is tested, tests/clients/test_spool_damage.py):

* A damaged record costs that record only: the reader resynchronizes on the next ``MARK``
  whose record passes its CRC, so every intact record after it is still sent. A record torn
  by a crash mid-append (its ``append`` never returned, so nobody was promised it) is cut
  off the end. Segments written before MARK existed (no MARK at their start) are read as
  they were: up to their first damaged record.
* Files the spool did not write are left alone: only regular files named exactly as above
  are read, written or deleted; anything else (other names, directories, symbolic links)
  is ignored.
* No symbolic link is followed: the directory and every file are opened ``O_NOFOLLOW``,
  and the directory's mode is set through its own descriptor, so a spool path that is a
  link is refused rather than a stranger's directory made ``0700``.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import re
import stat
import struct
import threading
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rtrl_client.spool_lock import SpoolLock, SpoolLocked

log = logging.getLogger("rtrl_client")

MARK = b"\xf0SP2"
"""Starts every record: where a reader resynchronizes after a damaged one. Its first byte
read as a legacy record's length would be over 4 GB, so the two formats never mix up."""
_RECORD_HEADER = struct.Struct(">4sII")
_LEGACY_HEADER = struct.Struct(">II")
_ACK = struct.Struct(">Q")
_SEGMENT_NAME = re.compile(r"([0-9]{16})\.(seg|acks)")
"""The only names the spool reads, writes or deletes (ASCII digits only)."""
_NOFOLLOW = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)

__all__ = ["MARK", "Spool", "SpoolFull", "SpoolLocked", "SpooledEvent"]


class SpoolFull(RuntimeError):
    """The spool holds max_spool_bytes of undelivered events: the event was not recorded.
    The gateway has been unreachable (or refusing the key) for a long time."""


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
    """Marked, length-prefixed, CRC-checked records in append-only segment files, bounded in
    bytes. Thread-safe: product threads append while the sender reads and acks. Raises
    SpoolLocked when another process (this SDK's or the Node SDK's) holds the directory."""

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_bytes: int,
        segment_bytes: int,
        fsync: bool = True,
    ) -> None:
        self.directory = Path(directory)
        _own_directory(self.directory)
        self._max_bytes = max_bytes
        self._segment_bytes = segment_bytes
        self._fsync = fsync
        self._lock = threading.Lock()
        self._owner = SpoolLock.acquire(self.directory)
        self._unanswered: collections.OrderedDict[int, _Slot] = collections.OrderedDict()
        self._next_seq = 0
        self._bytes = 0
        self._active: _Segment | None = None
        self._active_fd: int | None = None
        self._next_segment = 1
        try:
            self._load()
        except BaseException:
            self._owner.release()
            raise

    # -- product threads --

    def append(self, payloads: Sequence[bytes]) -> list[int]:
        """Record payloads durably (one write, one fsync); their sequence numbers, in order."""
        if not payloads:
            return []
        frames = [_RECORD_HEADER.pack(MARK, len(p), zlib.crc32(p)) + p for p in payloads]
        size = sum(len(f) for f in frames)
        with self._lock:
            if self._owner.released:
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
                    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | _NOFOLLOW
                    with os.fdopen(os.open(segment.acks_path, flags, 0o600), "ab") as acks:
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
            self._owner.release()

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
                segment.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | _NOFOLLOW, 0o600
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
        found = _own_files(self.directory)
        segments = sorted(n for n, kind in found if kind == "seg")
        for number in segments:
            self._load_segment(_Segment(number, self.directory), started)
        for number, kind in found:
            if kind == "acks" and (number, "seg") not in found:
                # An ack file outlives its segment when a crash falls between the two
                # unlinks; a later segment of that number must not inherit its acks.
                (self.directory / f"{number:016d}.acks").unlink(missing_ok=True)
        self._next_segment = max((n for n, _ in found), default=0) + 1
        if self._unanswered:
            log.info(
                "spool %s: %d undelivered events from an earlier run will be resent",
                self.directory,
                len(self._unanswered),
            )

    def _load_segment(self, segment: _Segment, started: float) -> None:
        data = _read_own(segment.path)
        records, end, skipped = _scan(data)
        if skipped or end < len(data):
            log.warning(
                "spool %s: %s: skipped %d damaged bytes, cut %d bytes of a torn record; "
                "kept the %d intact records",
                self.directory,
                segment.path.name,
                skipped,
                len(data) - end,
                len(records),
            )
        if end < len(data):
            fd = os.open(segment.path, os.O_WRONLY | _NOFOLLOW)
            try:
                os.ftruncate(fd, end)
                os.fsync(fd)
            finally:
                os.close(fd)
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


def _scan(data: bytes) -> tuple[list[tuple[int, bytes]], int, int]:
    """The intact records of a segment as (offset, payload), where the last one ends, and
    how many damaged bytes were skipped before it."""
    if _legacy_record(data, 0) is not None:
        return _scan_legacy(data)
    records: list[tuple[int, bytes]] = []
    offset = end = skipped = 0
    while offset < len(data):
        payload = _record(data, offset)
        if payload is not None:
            records.append((offset, payload))
            skipped += offset - end
            offset = end = offset + _RECORD_HEADER.size + len(payload)
            continue
        # Damaged (or torn): the next mark may start an intact record.
        offset = data.find(MARK, offset + 1)
        if offset < 0:
            break
    return records, end, skipped


def _record(data: bytes, offset: int) -> bytes | None:
    """The payload of the intact record at ``offset``, or None."""
    if offset + _RECORD_HEADER.size > len(data):
        return None
    mark, length, crc = _RECORD_HEADER.unpack_from(data, offset)
    start = offset + _RECORD_HEADER.size
    payload = data[start : start + length]
    # length 0 never is a record: it also rejects a zero-filled tail a crash may leave.
    if mark != MARK or length == 0 or len(payload) < length or zlib.crc32(payload) != crc:
        return None
    return payload


def _legacy_record(data: bytes, offset: int) -> bytes | None:
    """The payload of the intact record without MARK (the format before it) at ``offset``."""
    if offset + _LEGACY_HEADER.size > len(data):
        return None
    length, crc = _LEGACY_HEADER.unpack_from(data, offset)
    start = offset + _LEGACY_HEADER.size
    payload = data[start : start + length]
    if length == 0 or len(payload) < length or zlib.crc32(payload) != crc:
        return None
    return payload


def _scan_legacy(data: bytes) -> tuple[list[tuple[int, bytes]], int, int]:
    """A segment written before MARK: its records up to the first damaged one."""
    records, offset = [], 0
    while (payload := _legacy_record(data, offset)) is not None:
        records.append((offset, payload))
        offset += _LEGACY_HEADER.size + len(payload)
    return records, offset, 0


def _read_acks(path: Path) -> set[int]:
    try:
        data = _read_own(path)
    except FileNotFoundError:
        return set()
    whole = len(data) - len(data) % _ACK.size  # a torn last ack only means one resend
    return {offset for (offset,) in _ACK.iter_unpack(data[:whole])}


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _own_directory(directory: Path) -> None:
    """Create ``directory`` (0700) if need be and make it its owner's alone, through its own
    descriptor: a directory that is a symbolic link is refused, never followed."""
    # Events hold users' code and messages: the spool is its owner's alone.
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise OSError(
                exc.errno, f"spool {directory} is not a directory of its own (a symbolic link?)"
            ) from None
        raise
    try:
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def _own_files(directory: Path) -> set[tuple[int, str]]:
    """The spool's own files, as (segment number, "seg" | "acks"): regular files named as
    the spool names them. Anything else in the directory is somebody else's."""
    found = set()
    with os.scandir(directory) as entries:
        for entry in entries:
            name = _SEGMENT_NAME.fullmatch(entry.name)
            if name and entry.is_file(follow_symlinks=False):
                found.add((int(name.group(1)), name.group(2)))
    return found


def _read_own(path: Path) -> bytes:
    """A file of the spool's, read whole, without following a symbolic link."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file")
        return file.read()
