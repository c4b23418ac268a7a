"""Who may ask for completions, and how much: the serving API's use of the one door
(rtrl/admission.py).

The same API keys as the ingest gateway (rtrl/api_keys.py), with their own scope
(``completions``, never implied by ``*``). Everything is decided from the request's
headers before its body is read, in this order: the key (401), its scope (403), the
body's declared size (429 over the key's budget, 413 over the server's bound), the
key's requests per second (shared by every server through Redis) and its completions in
flight (per server process), both 429. The token budget, which the body states, is
checked once the body is parsed. Without ``auth_required`` the door is open: everyone
is admitted as nobody, and only the server's bound on a body holds.
"""

from __future__ import annotations

import math

import redis.asyncio as aioredis
from aiohttp import web

from rtrl import signing
from rtrl.admission import Admission, Refusal
from rtrl.api_keys import COMPLETIONS, ApiKey, KeyCache, KeyVerifier, RateLimiter
from rtrl.config import StackSettings
from rtrl.inference.config import InferenceSettings
from rtrl.inference.openai_errors import error_response


def serving_door(
    stack: StackSettings, settings: InferenceSettings, redis: aioredis.Redis
) -> Admission:
    """The serving API's door: keyed when ``auth_required`` (the default), open otherwise."""
    if not settings.auth_required:
        return Admission(None, None, max_request_bytes=settings.max_request_bytes)
    verifier = KeyVerifier(signing.parse_public_keys(stack.api_key_public_keys))
    return Admission(
        KeyCache(redis, settings.key_cache_ttl_s, verifier),
        RateLimiter(redis),
        max_request_bytes=settings.max_request_bytes,
    )


async def admit(
    door: Admission, authorization: str, content_length: int | None
) -> tuple[ApiKey | None, Refusal | None]:
    """The key, or why the request is refused, from its headers alone."""
    key, refusal = await door.authenticate(authorization)
    if refusal is None:
        refusal = (
            _scope_refusal(door, key)
            or door.size_refusal(key, content_length)
            or await door.rate_refusal(key, 1, "completions")
            # Last, and nothing awaited after it: the caller counts the request in flight
            # (door.serving) in the same step of the event loop, so a flood on one key
            # cannot all pass this check before the first of it is counted.
            or door.concurrency_refusal(key, "completions")
        )
    return key, refusal


def _scope_refusal(door: Admission, key: ApiKey | None) -> Refusal | None:
    if key is None or key.allows(COMPLETIONS):
        return None
    return door.refuse(
        Refusal(
            403,
            f"the API key of client {key.client_id!r} may not ask for completions "
            f"(scopes: {', '.join(sorted(key.scopes))})",
        )
    )


def refused(refusal: Refusal) -> web.Response:
    """The HTTP answer to a refusal: its status, OpenAI's error body and, where waiting
    helps, Retry-After in whole seconds (at least one)."""
    headers = (
        {"Retry-After": str(max(1, math.ceil(refusal.retry_after_s)))}
        if refusal.retry_after_s
        else None
    )
    return error_response(refusal.status, refusal.message, headers=headers)
