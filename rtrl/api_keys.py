"""API keys of product clients: issued, scoped, budgeted, rotated, revoked; shared by the
ingest gateway (telemetry) and the serving API (completions).

A key is ``rtrl_<24 random bytes, urlsafe base64>``. Only its SHA-256 is stored, in the
Redis hash ``rtrl:ingest:key:<sha256 hex>`` with the client's id, what it may do (event
types, ``*`` for all of them; ``completions`` for the serving API, never implied by
``*``), its budgets and whether it is revoked; the set ``rtrl:ingest:client:<client_id>``
lists a client's key hashes, for rotation. A key that leaks from Redis cannot be used; a
key that leaks from a client is revoked without touching the client's other keys.

Records are signed by the operator (Ed25519, rtrl/signing.py, purpose "api-key"): the CLI
holds the private key, gateways and inference servers only its public key, so whoever can
write to Redis still cannot mint a key, widen one's scopes or budgets, or un-revoke one
(short of restoring a copy of an older signed record). A record that does not verify is
an unknown key.

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
import logging
import secrets
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from rtrl import signing
from rtrl.key_budgets import ONE_CLIENT

log = logging.getLogger(__name__)

KEY_PREFIX = "rtrl:ingest:key:"
CLIENT_PREFIX = "rtrl:ingest:client:"
BUCKET_PREFIX = "rtrl:ingest:bucket:"
BYTE_BUCKET_PREFIX = BUCKET_PREFIX + "bytes:"
"""A key's bucket of event bytes (under BUCKET_PREFIX: the same Redis users spend it)."""
SERVED_PREFIX = "rtrl:served:"
"""``rtrl:served:<rollout_id>`` -> the client_id whose key was served that rollout (set by
the serving API, read by the gateway: telemetry about it from another key is refused)."""
PRIVATE_USERS = "rtrl:ingest:private-users"
"""Set of user ids registered as private: their events are counted, never published."""
ALL_EVENTS = "*"
EVENT_TYPES = frozenset({"edit_shown", "edit_outcome", "persistence", "followup"})
COMPLETIONS = "completions"
"""The scope of the serving API (POST /v1/completions)."""
SCOPES = EVENT_TYPES | {ALL_EVENTS, COMPLETIONS}

SIGNED_FIELDS = (
    "client_id", "scopes", "rate_per_s", "burst", "revoked", "expires_ms",
    "max_request_bytes", "max_tokens", "max_concurrency",
)  # fmt: skip
"""The record's fields the operator's signature covers, in the order they are signed."""


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
    max_request_bytes: int = 0
    """Serving API: the largest request body, 0 for the server's own bound only."""
    max_tokens: int = 0
    """Serving API: the most tokens one completion may ask for, 0 for the server's bound only."""
    max_concurrency: int = 0
    """Serving API: completions in flight at once per server process, 0 for unlimited."""

    def usable(self, at_ms: int) -> str | None:
        """Why the key cannot be used now, or None."""
        if self.revoked:
            return f"API key of client {self.client_id!r} was revoked"
        if self.expires_ms and at_ms >= self.expires_ms:
            return f"API key of client {self.client_id!r} expired (rotated)"
        return None

    def allows(self, event_type: str) -> bool:
        """May send events of this type (``*`` covers every event type, not completions)."""
        return (
            ALL_EVENTS in self.scopes and event_type in EVENT_TYPES
        ) or event_type in self.scopes


class KeyAuthority:
    """The operator's half: signs key records (the CLI, the demo; never a service)."""

    def __init__(self, private_key: str) -> None:
        self._signer = signing.Signer(private_key, signing.Purpose.API_KEY)

    def signed(self, digest: str, fields: dict[str, str]) -> dict[str, str]:
        """``fields`` with the signature over them (and the key's hash) added."""
        signature = self._signer.sign(_claim(digest, fields))
        return {
            **fields,
            "sig": base64.b64encode(signature).decode(),
            "signer": self._signer.key_id,
        }


def _claim(digest: str, fields: dict[str, str]) -> bytes:
    return "\n".join(
        [digest, *(f"{name}={fields.get(name, '')}" for name in SIGNED_FIELDS)]
    ).encode()


def _str(reply: bytes | str) -> str:
    """A Redis reply as text (clients here are opened without decode_responses)."""
    return reply.decode() if isinstance(reply, bytes) else reply


def _text(fields: dict) -> dict[str, str]:
    return {
        (k.decode() if isinstance(k, bytes) else k): (
            v.decode() if isinstance(v, bytes) else str(v)
        )
        for k, v in fields.items()
    }


async def issue_key(
    redis: aioredis.Redis,
    authority: KeyAuthority,
    client_id: str,
    scopes: frozenset[str] | set[str] | None = None,
    rate_per_s: float | None = None,
    burst: float | None = None,
    *,
    max_request_bytes: int = 0,
    max_tokens: int = 0,
    max_concurrency: int = 0,
) -> str:
    """A new key for ``client_id``, signed by ``authority``; returned once, stored only as its hash.

    ``rate_per_s`` counts events at the gateway and completions at the serving API. A budget
    not given here is none (unlimited): the operator's commands give each key its budgets
    (`rtrl keys create` those of rtrl/key_budgets.py ONE_CLIENT unless told otherwise)."""
    if not client_id.strip():
        raise ValueError("client_id must be non-empty")
    wanted = frozenset(scopes) if scopes else frozenset({ALL_EVENTS})
    unknown = wanted - SCOPES
    if unknown:
        raise ValueError(f"unknown scopes {sorted(unknown)}; known: {sorted(SCOPES)}")
    if rate_per_s is not None and rate_per_s < 0:
        raise ValueError(f"rate_per_s must be >= 0, got {rate_per_s}")
    for name, value in (
        ("max_request_bytes", max_request_bytes),
        ("max_tokens", max_tokens),
        ("max_concurrency", max_concurrency),
    ):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    api_key = "rtrl_" + base64.urlsafe_b64encode(secrets.token_bytes(24)).decode().rstrip("=")
    digest = key_hash(api_key)
    rate = float(rate_per_s or 0)
    fields = _text(
        {
            "client_id": client_id,
            "scopes": ",".join(sorted(wanted)),
            "rate_per_s": rate,
            "burst": float(burst if burst is not None else max(rate, 1.0)),
            "revoked": 0,
            "expires_ms": 0,
            "max_request_bytes": int(max_request_bytes),
            "max_tokens": int(max_tokens),
            "max_concurrency": int(max_concurrency),
        }
    )
    async with redis.pipeline(transaction=True) as pipe:
        # redis types the mapping's keys invariantly (Mapping[FieldT, ...]): a dict[str, ...] is refused.
        pipe.hset(
            KEY_PREFIX + digest,
            mapping={**authority.signed(digest, fields), "created_ms": now_ms()},  # type: ignore[dict-item]
        )
        pipe.sadd(CLIENT_PREFIX + client_id, digest)
        await pipe.execute()
    return api_key


async def _amend(
    redis: aioredis.Redis, authority: KeyAuthority, digest: str, **changes: object
) -> bool:
    """Change signed fields of a key record and sign it again; False if there is no record."""
    async with redis.pipeline(transaction=True) as pipe:
        await pipe.watch(KEY_PREFIX + digest)
        fields = _text(await pipe.hgetall(KEY_PREFIX + digest))
        if not fields:
            return False
        fields.update(_text(changes))
        pipe.multi()
        signed = authority.signed(digest, {k: fields.get(k, "0") for k in SIGNED_FIELDS})
        pipe.hset(KEY_PREFIX + digest, mapping=signed)  # type: ignore[arg-type]  # as in issue_key
        await pipe.execute()
    return True


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


async def revoke_key(redis: aioredis.Redis, authority: KeyAuthority, api_key_or_hash: str) -> bool:
    """Revoke one key (given as the key or its hash); False if it does not exist."""
    digest = (
        api_key_or_hash
        if len(api_key_or_hash) == 64 and not api_key_or_hash.startswith("rtrl_")
        else key_hash(api_key_or_hash)
    )
    return await _amend(redis, authority, digest, revoked=1)


async def rotate_keys(
    redis: aioredis.Redis, authority: KeyAuthority, client_id: str, grace_s: float, **issue
) -> str:
    """A new key for the client, with the scopes and budgets of its newest key (one client's,
    ONE_CLIENT, if it has none) unless ``issue`` says otherwise; its existing keys expire
    after ``grace_s``."""
    old = await redis.smembers(CLIENT_PREFIX + client_id)
    current = [_text(await redis.hgetall(KEY_PREFIX + _str(d))) for d in old]
    newest = max((f for f in current if f), key=lambda f: int(f.get("created_ms", 0)), default=None)
    if newest is None:
        issue = {**ONE_CLIENT.issue_args(), **issue}
    else:
        issue = {
            "scopes": set(newest["scopes"].split(",")),
            "rate_per_s": float(newest["rate_per_s"]),
            "burst": float(newest["burst"]),
            **{
                name: int(newest.get(name, 0))
                for name in ("max_request_bytes", "max_tokens", "max_concurrency")
            },
            **issue,
        }
    new_key = await issue_key(redis, authority, client_id, **issue)
    expires = now_ms() + int(grace_s * 1000)
    for digest in old:
        await _amend(redis, authority, _str(digest), expires_ms=expires)
    return new_key


async def list_keys(redis: aioredis.Redis, client_id: str | None = None) -> list[dict[str, str]]:
    """The records of a client's keys, or of every client's (None), by client then hash."""
    if client_id is None:
        clients = sorted(
            [
                _str(name).removeprefix(CLIENT_PREFIX)
                async for name in redis.scan_iter(CLIENT_PREFIX + "*")
            ]
        )
    else:
        clients = [client_id]
    out = []
    for client in clients:
        for digest in sorted(_str(d) for d in await redis.smembers(CLIENT_PREFIX + client)):
            fields = await redis.hgetall(KEY_PREFIX + digest)
            if fields:
                out.append({"key_hash": digest, **_text(fields)})
    return out


async def register_private_user(redis: aioredis.Redis, user_id: str, private: bool = True) -> None:
    """Mark a user as private (or not): the gateway never publishes their events."""
    await (redis.sadd if private else redis.srem)(PRIVATE_USERS, user_id)


def _parse(digest: str, fields: dict[str, str]) -> ApiKey:
    return ApiKey(
        key_hash=digest,
        client_id=fields["client_id"],
        scopes=frozenset(fields["scopes"].split(",")),
        rate_per_s=float(fields["rate_per_s"]),
        burst=float(fields["burst"]),
        revoked=fields["revoked"] == "1",
        expires_ms=int(fields["expires_ms"]),
        max_request_bytes=int(fields["max_request_bytes"]),
        max_tokens=int(fields["max_tokens"]),
        max_concurrency=int(fields["max_concurrency"]),
    )


async def bearer_key(keys: KeyCache, authorization: str) -> tuple[ApiKey | None, str | None]:
    """The key an ``Authorization: Bearer`` header names, and why it cannot be used now
    (None: it can): a 401's message. Looks at the header only, never at a body."""
    scheme, _, token = authorization.partition(" ")
    if not authorization.isascii():
        return None, "malformed API key: not ASCII"
    if scheme.lower() != "bearer" or not token.strip():
        return None, "missing API key: send 'Authorization: Bearer <key>'"
    key = await keys.lookup(token.strip())
    if key is None:
        return None, "unknown API key"
    return key, key.usable(now_ms())


class KeyVerifier:
    """The servers' half: public keys of the operator (more than one while keys rotate)."""

    def __init__(self, public_keys: list[str]) -> None:
        self._verifier = signing.Verifier(public_keys, signing.Purpose.API_KEY)

    def problem(self, digest: str, fields: dict[str, str]) -> str | None:
        """None if the operator signed this record; else why it is no key."""
        try:
            signature = base64.b64decode(fields.get("sig", ""), validate=True)
        except ValueError:
            return "a signature that is not base64"
        return self._verifier.signature_problem(
            _claim(digest, fields), signature, fields.get("signer")
        )


class KeyCache:
    """Key records by hash, each re-read from Redis at most every ``ttl_s``; a record the
    operator did not sign (``verifier``) is no key, and is counted in ``forged``.

    Records are never deleted (a revocation is a signed change), so a record that vanishes
    means Redis lost it (a FLUSHALL, a restore from an older copy): the last verified copy
    keeps serving rather than turning every product request into a 401. Nothing new can be
    granted that way, only what the operator signed before."""

    def __init__(self, redis: aioredis.Redis, ttl_s: float, verifier: KeyVerifier) -> None:
        self._redis = redis
        self._ttl_s = ttl_s
        self._verifier = verifier
        self._entries: dict[str, tuple[float, ApiKey | None]] = {}
        self._verified: dict[str, ApiKey] = {}
        self.forged = 0
        self.vanished = 0
        """Lookups answered from the last verified copy because Redis no longer held the record."""

    async def lookup(self, api_key: str) -> ApiKey | None:
        digest = key_hash(api_key)
        now = time.monotonic()
        cached = self._entries.get(digest)
        if cached is not None and now - cached[0] < self._ttl_s:
            return cached[1]
        fields = _text(await self._redis.hgetall(KEY_PREFIX + digest))
        record = None
        if fields:
            problem = self._verifier.problem(digest, fields)
            if problem is None:
                record = self._verified[digest] = _parse(digest, fields)
            else:
                self.forged += 1
                log.warning(
                    "API key record %s… in Redis is not the operator's (%s): treated as no key",
                    digest[:12],
                    problem,
                )
        elif digest in self._verified:
            record = self._verified[digest]
            if not self.vanished:
                log.warning(
                    "API key record %s… is gone from Redis (was Redis lost?): serving its last verified copy",
                    digest[:12],
                )
            self.vanished += 1
        if len(self._entries) > 100_000:
            self._entries.clear()
        if len(self._verified) > 100_000:
            self._verified.clear()
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
        wait_ms = await self._script(
            keys=[BUCKET_PREFIX + key.key_hash], args=[key.rate_per_s, key.burst, now_ms(), wanted]
        )
        return int(wait_ms) / 1000

    async def take_bytes(self, key: ApiKey, size: int, bytes_per_event: int) -> float:
        """0.0 if the key may write ``size`` bytes of events now, else the seconds to wait.

        The byte bucket is the key's event bucket scaled by ``bytes_per_event``: its signed
        rate and burst say how much it may send, and the gateway's setting how large an
        event it pays for on average, so a key of 68 KB events spends its bytes long before
        its count. A key without a rate has no byte budget either."""
        if key.rate_per_s <= 0 or size == 0 or bytes_per_event <= 0:
            return 0.0
        rate, burst = key.rate_per_s * bytes_per_event, key.burst * bytes_per_event
        wait_ms = await self._script(
            keys=[BYTE_BUCKET_PREFIX + key.key_hash], args=[rate, burst, now_ms(), min(size, burst)]
        )
        return int(wait_ms) / 1000
