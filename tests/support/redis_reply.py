"""Redis values the tests read back. redis-py types a reply as ``bytes | str | None`` (it
cannot know whether a client decodes responses); the tests' clients never do, and a key
the test expects to be there but is not is a failure of the test."""

from __future__ import annotations

import redis


def stored(client: redis.Redis, key: str) -> bytes:
    """The value at ``key``, which must exist."""
    value = client.get(key)
    assert value is not None, f"nothing stored at {key}"
    assert isinstance(value, bytes), f"{key}: the client decodes responses"
    return value
