"""The one checksum used for blobs and tensors (kept free of torch so the server starts fast)."""

from __future__ import annotations

import xxhash


def xxh3_hex(data: bytes | memoryview) -> str:
    """xxh3_128 of ``data`` as 32 hex digits."""
    return xxhash.xxh3_128_hexdigest(data)
