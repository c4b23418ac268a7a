"""Who may ask for completions, and how much: the serving API's door.

The same API keys as the ingest gateway (rtrl/api_keys.py), with their own scope
(``completions``, never implied by ``*``). Everything is decided from the request's
headers before its body is read, except the token budget, which the body states. Each
key's budgets: requests per second (shared by every server through Redis), completions
in flight at once (per server process), request size and tokens per completion; over
any of them the answer is 429 and says which.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from rtrl.api_keys import COMPLETIONS, ApiKey, KeyCache, RateLimiter, bearer_key


@dataclass(frozen=True)
class Denied:
    """A refused request: its HTTP status and why."""

    status: int
    message: str
    retry_after_s: float = 0.0


class ServingDoor:
    def __init__(self, keys: KeyCache, limiter: RateLimiter, max_request_bytes: int) -> None:
        self.keys = keys
        self._limiter = limiter
        self._max_request_bytes = max_request_bytes
        self.in_flight: Counter[str] = Counter()
        """Completions being served, per key hash."""
        self.refused: Counter[int] = Counter()
        """Requests refused, by HTTP status."""

    async def admit(
        self, authorization: str, content_length: int | None
    ) -> tuple[ApiKey | None, Denied | None]:
        """The key, or why the request is refused, from its headers alone."""
        key, denied = await self._admit(authorization, content_length)
        if denied is not None:
            self.refused[denied.status] += 1
        return key, denied

    async def _admit(
        self, authorization: str, content_length: int | None
    ) -> tuple[ApiKey | None, Denied | None]:
        key, why = await bearer_key(self.keys, authorization)
        if why is not None:
            return key, Denied(401, why)
        assert key is not None
        if not key.allows(COMPLETIONS):
            return key, Denied(
                403,
                f"the API key of client {key.client_id!r} may not ask for completions "
                f"(scopes: {', '.join(sorted(key.scopes))})",
            )
        if content_length is not None and content_length > self.body_limit(key):
            return key, self.too_large(key, content_length)
        if key.max_concurrency and self.in_flight[key.key_hash] >= key.max_concurrency:
            return key, Denied(
                429,
                f"client {key.client_id!r} has {key.max_concurrency} completions in flight, "
                "its budget: retry when one ends",
                1.0,
            )
        wait_s = await self._limiter.take(key, 1)
        if wait_s > 0:
            return key, Denied(
                429,
                f"rate limit of client {key.client_id!r} ({key.rate_per_s:g} completions/s) spent: "
                f"retry in {wait_s:.2f} s",
                wait_s,
            )
        return key, None

    def body_limit(self, key: ApiKey | None) -> int:
        """The largest body this request may have."""
        if key is not None and key.max_request_bytes:
            return min(key.max_request_bytes, self._max_request_bytes)
        return self._max_request_bytes

    def too_large(self, key: ApiKey | None, size: int) -> Denied:
        if key is not None and key.max_request_bytes and size > key.max_request_bytes:
            return Denied(
                429,
                f"a request of {size} bytes is over client {key.client_id!r}'s budget of {key.max_request_bytes} bytes",
            )
        return Denied(
            413,
            f"a request of {size} bytes is over the server's bound of {self._max_request_bytes} bytes",
        )

    def tokens_denied(self, key: ApiKey | None, max_tokens: int) -> Denied | None:
        if key is not None and key.max_tokens and max_tokens > key.max_tokens:
            self.refused[429] += 1
            return Denied(
                429,
                f"max_tokens {max_tokens} is over client {key.client_id!r}'s budget "
                f"of {key.max_tokens} tokens per completion",
            )
        return None

    @contextlib.contextmanager
    def serving(self, key: ApiKey | None) -> Iterator[None]:
        """Counts the completion in flight for its key while it is served."""
        if key is None:
            yield
            return
        self.in_flight[key.key_hash] += 1
        try:
            yield
        finally:
            self.in_flight[key.key_hash] -= 1
            if not self.in_flight[key.key_hash]:
                del self.in_flight[key.key_hash]
