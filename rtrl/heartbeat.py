"""Service heartbeats in Redis: how the supervisor and `rtrl status` see health.

Each process writes ``rtrl:hb:<service>:<instance>`` (a JSON document with a
short TTL). A missing key means the process is down or wedged.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Callable

import redis.asyncio as aioredis

KEY_PREFIX = "rtrl:hb:"
TTL_S = 10


def key(service: str, instance: str) -> str:
    return f"{KEY_PREFIX}{service}:{instance}"


async def beat(client: aioredis.Redis, service: str, instance: str, status: dict[str, Any]) -> None:
    doc = {"service": service, "instance": instance, "ts": time.time(), **status}
    await client.set(key(service, instance), json.dumps(doc), ex=TTL_S)


async def beat_forever(
    client: aioredis.Redis,
    service: str,
    instance: str,
    status: Callable[[], dict[str, Any]],
    interval_s: float = 1.0,
) -> None:
    while True:
        await beat(client, service, instance, status())
        await asyncio.sleep(interval_s)


def read_all(client) -> list[dict[str, Any]]:
    """Every live heartbeat, from a synchronous redis client."""
    docs = []
    for k in sorted(client.scan_iter(f"{KEY_PREFIX}*")):
        raw = client.get(k)
        if raw:
            docs.append(json.loads(raw))
    return docs
