"""Byte-level transforms that make a delta's integers easy for zstd: zigzag, LEB128
varints and byte planes. Numba loops over numpy arrays; inverse pairs are exact.

Gaps between changed positions are near-geometric with a mean of ~150, so their low
byte is close to random and their high bytes are almost always zero: split into
byte planes, zstd's entropy stage codes each plane at close to its own entropy.
Differences are small signed integers (mostly ±1): zigzag + LEB128 makes nearly
every one a single byte.
"""

from __future__ import annotations

import numba
import numpy as np


def zigzag(values: np.ndarray) -> np.ndarray:
    """int64 -> uint64 with small magnitudes first: 0, -1, 1, -2, 2 -> 0, 1, 2, 3, 4."""
    values = values.astype(np.int64, copy=False)
    return ((values << 1) ^ (values >> 63)).view(np.uint64)


def unzigzag(codes: np.ndarray) -> np.ndarray:
    codes = codes.astype(np.uint64, copy=False)
    return ((codes >> np.uint64(1)) ^ (np.uint64(0) - (codes & np.uint64(1)))).view(np.int64)


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _put_varint(v: np.uint64, out: np.ndarray, n: int) -> int:  # pragma: no cover - compiled
    """Write uint64 v as LEB128 at out[n:]; return the index after it."""
    low7 = np.uint64(0x7F)
    while v > low7:
        out[n] = np.uint8(v & low7) | np.uint8(0x80)
        v >>= np.uint64(7)
        n += 1
    out[n] = np.uint8(v)
    return n + 1


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _leb128_encode(values: np.ndarray, out: np.ndarray) -> int:  # pragma: no cover - compiled
    n = 0
    for i in range(values.size):
        n = _put_varint(values[i], out, n)
    return n


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _leb128_decode(
    data: np.ndarray, out: np.ndarray
) -> tuple[int, int]:  # pragma: no cover - compiled
    """Returns (values decoded, bytes consumed); stops early on a malformed value."""
    n = 0
    i = 0
    while i < data.size and n < out.size:
        v = np.uint64(0)
        shift = 0
        while True:
            if i >= data.size or shift > 63:
                return n, -1
            b = np.uint64(data[i])
            i += 1
            v |= (b & np.uint64(0x7F)) << np.uint64(shift)
            shift += 7
            if b < 0x80:
                break
        out[n] = v
        n += 1
    return n, i


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _zigzag_leb128_encode(
    values: np.ndarray, out: np.ndarray
) -> int:  # pragma: no cover - compiled
    n = 0
    for i in range(values.size):
        signed = values[i]
        n = _put_varint(np.uint64((signed << 1) ^ (signed >> 63)), out, n)
    return n


def leb128_encode(values: np.ndarray) -> bytes:
    values = np.ascontiguousarray(values, dtype=np.uint64)
    out = np.empty(values.size * 10, dtype=np.uint8)
    return out[: _leb128_encode(values, out)].tobytes()


def zigzag_leb128_encode(values: np.ndarray, out: np.ndarray) -> memoryview:
    """leb128_encode(zigzag(values)) for int64 values, in one pass, into ``out`` (uint8,
    at least 10 bytes per value; reused between calls by its owner). A view into out."""
    values = np.ascontiguousarray(values, dtype=np.int64)
    if out.size < values.size * 10:
        raise ValueError(f"{out.size} bytes may not hold {values.size} varints")
    return out.data[: _zigzag_leb128_encode(values, out)]


def leb128_decode(data: bytes, count: int) -> np.ndarray:
    """Exactly ``count`` uint64 values that use up all of ``data``; ValueError otherwise."""
    out = np.empty(count, dtype=np.uint64)
    decoded, used = _leb128_decode(np.frombuffer(data, dtype=np.uint8), out)
    if decoded != count or used != len(data):
        raise ValueError(
            f"varint stream holds {decoded} whole values in {used} of {len(data)} bytes, expected exactly {count}"
        )
    return out


def to_planes(values: np.ndarray) -> bytes:
    """uint64 values as byte planes, every value's byte 0, then every byte 1, ..., as
    many planes as the largest value needs (at least one when there are values)."""
    values = np.ascontiguousarray(values, dtype="<u8")
    if not values.size:
        return b""
    width = max(1, (int(values.max()).bit_length() + 7) // 8)
    return values.view(np.uint8).reshape(-1, 8)[:, :width].T.tobytes()


def from_planes(data: bytes, count: int) -> np.ndarray:
    """The ``count`` values to_planes wrote into ``data`` (the plane count follows from its length)."""
    width, rest = divmod(len(data), count) if count else (0, len(data))
    if rest or width > 8 or (count and not width):
        raise ValueError(f"{len(data)} plane bytes cannot hold {count} uint64 values")
    out = np.zeros((count, 8), dtype=np.uint8)
    out[:, :width] = np.frombuffer(data, dtype=np.uint8).reshape(width, count).T
    return out.view("<u8").reshape(-1)
