"""API keys of product clients: issued, scoped, rate-limited, rotated, revoked.

A key is ``rtrl_<24 random bytes, urlsafe base64>``. Only its SHA-256 is stored, in the
Redis hash ``rtrl:ingest:key:<sha256 hex>`` with the client's id, the event types it
may send (``*`` for all), its rate limit and whether it is revoked; the set
``rtrl:ingest:client:<client_id>`` lists a client's key hashes, for rotation. A key
that leaks from Redis cannot be used; a key that leaks from a client is revoked
without touching the client's other keys.

Rotation issues a new key and gives the client's old ones an expiry (a grace period
to roll the new key out) instead of revoking them at once.

The gateway looks keys up through ``KeyCache`` (one Redis read per key per
``ttl_s``), so a revocation takes effect within ``ttl_s`` on every gateway. Rate
limits are token buckets in Redis, shared by every gateway instance: one script call
per request takes as many tokens as the request has events.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

KEY_PREFIX = "rtrl:ingest:key:"
CLIENT_PREFIX = "rtrl:ingest:client:"
BUCKET_PREFIX = "rtrl:ingest:bucket:"
PRIVATE_USERS = "rtrl:ingest:private-users"
"""Set of user ids registered as private: their events are counted, never published."""
ALL_EVENTS = "*"
EVENT_TYPES = frozenset({"edit_shown", "edit_outcome", "persistence", "followup"})


def key_hash(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def now_ms() -> int:
    return time.time_ns() // 1_000_000


# Produced by KeyCache.lookup; consumed by the gateway's request check.
@dataclass(frozen=True)
class ApiKey:
    key_hash: str
    client_id: str
    scopes: frozenset[str]
    """Event types (TelemetryEvent payload names) this key may send; ``*`` for all."""
    rate_per_s: float
    """Events per second, 0 for unlimited."""
    burst: float
    revoked: bool
    expires_ms: int
    """0: never; otherwise the key stops working at this wall-clock time (rotation grace)."""

    def usable(self, at_ms: int) -> str | None:
        """Why the key cannot be used now, or None."""
        if self.revoked:
            return f"API key of client {self.client_id!r} was revoked"
        if self.expires_ms and at_ms >= self.expires_ms:
            return f"API key of client {self.client_id!r} expired (rotated)"
        return None

    def allows(self, event_type: str) -> bool:
        return ALL_EVENTS in self.scopes or event_type in self.scopes


async def issue_key(
    redis: aioredis.Redis,
    client_id: str,
    scopes: frozenset[str] | set[str] | None = None,
    rate_per_s: float | None = None,
    burst: float | None = None,
) -> str:
    """A new key for ``client_id``; returned once, stored only as its hash."""
    if not client_id.strip():
        raise ValueError("client_id must be non-empty")
    wanted = frozenset(scopes) if scopes else frozenset({ALL_EVENTS})
    unknown = wanted - EVENT_TYPES - {ALL_EVENTS}
    if unknown:
        raise ValueError(f"unknown event types {sorted(unknown)}; known: {sorted(EVENT_TYPES)}")
    if rate_per_s is not None and rate_per_s < 0:
        raise ValueError(f"rate_per_s must be >= 0, got {rate_per_s}")
    api_key = "rtrl_" + base64.urlsafe_b64encode(secrets.token_bytes(24)).decode().rstrip("=")
    digest = key_hash(api_key)
    rate = float(rate_per_s or 0)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(KEY_PREFIX + digest, mapping={
            "client_id": client_id,
            "scopes": ",".join(sorted(wanted)),
            "rate_per_s": rate,
            "burst": float(burst if burst is not None else max(rate, 1.0)),
            "revoked": 0,
            "expires_ms": 0,
            "created_ms": now_ms(),
        })
        pipe.sadd(CLIENT_PREFIX + client_id, digest)
        await pipe.execute()
    return api_key


def call_sync(redis_url: str, function, *args, **kwargs):
    """``await function(redis, *args, **kwargs)`` from synchronous code (the CLI, the demo,
    the bench), on a client opened and closed around the call."""
    import asyncio

    async def call():
        redis = aioredis.Redis.from_url(redis_url)
        try:
            return await function(redis, *args, **kwargs)
        finally:
            await redis.aclose()

    return asyncio.run(call())


async def revoke_key(redis: aioredis.Redis, api_key_or_hash: str) -> bool:
    """Revoke one key (given as the key or its hash); False if it does not exist."""
    digest = api_key_or_hash if len(api_key_or_hash) == 64 and not api_key_or_hash.startswith("rtrl_") else key_hash(api_key_or_hash)
    if not await redis.exists(KEY_PREFIX + digest):
        return False
    await redis.hset(KEY_PREFIX + digest, "revoked", 1)
    return True


async def rotate_keys(redis: aioredis.Redis, client_id: str, grace_s: float, **issue) -> str:
    """A new key for the client; its existing keys expire after ``grace_s``."""
    old = await redis.smembers(CLIENT_PREFIX + client_id)
    new_key = await issue_key(redis, client_id, **issue)
    expires = now_ms() + int(grace_s * 1000)
    async with redis.pipeline(transaction=False) as pipe:
        for digest in old:
            pipe.hset(KEY_PREFIX + digest.decode(), "expires_ms", expires)
        await pipe.execute()
    return new_key


async def list_keys(redis: aioredis.Redis, client_id: str) -> list[dict[str, str]]:
    out = []
    for digest in sorted(await redis.smembers(CLIENT_PREFIX + client_id)):
        fields = await redis.hgetall(KEY_PREFIX + digest.decode())
        out.append({"key_hash": digest.decode(), **{k.decode(): v.decode() for k, v in fields.items()}})
    return out


async def register_private_user(redis: aioredis.Redis, user_id: str, private: bool = True) -> None:
    """Mark a user as private (or not): the gateway never publishes their events."""
    await (redis.sadd if private else redis.srem)(PRIVATE_USERS, user_id)


def _parse(digest: str, fields: dict[bytes, bytes]) -> ApiKey:
    return ApiKey(
        key_hash=digest,
        client_id=fields[b"client_id"].decode(),
        scopes=frozenset(fields[b"scopes"].decode().split(",")),
        rate_per_s=float(fields[b"rate_per_s"]),
        burst=float(fields[b"burst"]),
        revoked=fields[b"revoked"] == b"1",
        expires_ms=int(fields[b"expires_ms"]),
    )


class KeyCache:
    """Key records by hash, each re-read from Redis at most every ``ttl_s``."""

    def __init__(self, redis: aioredis.Redis, ttl_s: float) -> None:
        self._redis = redis
        self._ttl_s = ttl_s
        self._entries: dict[str, tuple[float, ApiKey | None]] = {}

    async def lookup(self, api_key: str) -> ApiKey | None:
        digest = key_hash(api_key)
        now = time.monotonic()
        cached = self._entries.get(digest)
        if cached is not None and now - cached[0] < self._ttl_s:
            return cached[1]
        fields = await self._redis.hgetall(KEY_PREFIX + digest)
        record = _parse(digest, fields) if fields else None
        if len(self._entries) > 100_000:
            self._entries.clear()
        self._entries[digest] = (now, record)
        return record


# KEYS: bucket; ARGV: rate per s, burst, now ms, tokens wanted.
# Returns 0 if granted, else the milliseconds until that many tokens are there.
_BUCKET_SCRIPT = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local now = tonumber(ARGV[3])
local want = tonumber(ARGV[4])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(state[1]) or burst
local at = tonumber(state[2]) or now
tokens = math.min(burst, tokens + (now - at) * rate / 1000)
local wait = 0
if tokens >= want then
  tokens = tokens - want
else
  wait = math.ceil((want - tokens) * 1000 / rate)
end
redis.call('HSET', KEYS[1], 'tokens', tokens, 'at', now)
redis.call('PEXPIRE', KEYS[1], math.ceil(burst * 1000 / rate) + 1000)
return wait
"""


class RateLimiter:
    """Token buckets per key in Redis, shared by every gateway instance."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self._script = redis.register_script(_BUCKET_SCRIPT)

    async def take(self, key: ApiKey, events: int) -> float:
        """0.0 if the key may send ``events`` now, else the seconds to wait."""
        if key.rate_per_s <= 0 or events == 0:
            return 0.0
        # A request larger than the burst could never pass: it is judged against the burst.
        wanted = min(float(events), key.burst)
        wait_ms = await self._script(keys=[BUCKET_PREFIX + key.key_hash], args=[key.rate_per_s, key.burst, now_ms(), wanted])
        return int(wait_ms) / 1000
