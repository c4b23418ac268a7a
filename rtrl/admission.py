"""Who may ask, and how much: the one door of every listener that takes API keys.

The ingest gateway (events, over HTTP and gRPC) and the serving API (completions) admit a
request the same way, from its headers before its body is read: the ``Authorization:
Bearer`` key (rtrl/api_keys.py; 401 when missing, unknown, revoked or forged), its scope
(403), its budgets (429: requests per second shared through Redis, completions in flight
per process, request bytes, tokens per completion) and the server's own bound on a body
(413). Every refusal is a ``Refusal``, counted by status for the metrics; each front end
only renders it (an HTTP answer with Retry-After, a gRPC status).

Produced by the front ends' handlers; consumed by nothing downstream: a refused request
writes nothing.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Collection, Iterator
from dataclasses import dataclass

from rtrl.api_keys import ApiKey, KeyCache, RateLimiter, bearer_key


@dataclass(frozen=True)
class Refusal:
    """A request refused at the door: its HTTP status, why, and when to try again."""

    status: int
    message: str
    retry_after_s: float = 0.0


REFUSAL_STATUSES = (401, 403, 413, 429)
"""Every status the door refuses with: a missing or bad key, a scope, a body over the key's
bound, a budget. The front ends count each from the start, at 0 (rtrl_*_refused_requests)."""


class Admission:
    """API keys and budgets for one listener.

    ``keys`` None is an open door (a test gateway without Redis): everyone is admitted
    as nobody. ``max_request_bytes`` is the server's own bound on a body, whatever the key.
    """

    def __init__(
        self,
        keys: KeyCache | None,
        limiter: RateLimiter | None,
        *,
        max_request_bytes: int | None = None,
        bytes_per_event: int = 0,
    ) -> None:
        self.keys = keys
        self._limiter = limiter
        self._max_request_bytes = max_request_bytes
        self._bytes_per_event = bytes_per_event
        """Event bytes a key may send per event of its rate (0: no byte budget; the gateway's)."""
        self.refused: Counter[int] = Counter()
        """Requests refused, by HTTP status."""
        self.in_flight: Counter[str] = Counter()
        """Requests being served (``serving``), per key hash."""

    def refuse(self, refusal: Refusal) -> Refusal:
        """``refusal``, counted by its status: every refusal of this door, and one a
        listener words itself (the serving API's 403 names the completions scope)."""
        self.refused[refusal.status] += 1
        return refusal

    async def authenticate(self, authorization: str) -> tuple[ApiKey | None, Refusal | None]:
        """Who is asking, from the Authorization header alone."""
        if self.keys is None:
            return None, None
        key, why = await bearer_key(self.keys, authorization)
        if why is not None:
            return key, self.refuse(Refusal(401, why))
        return key, None

    def scope_refusal(self, key: ApiKey | None, kinds: Collection[str]) -> Refusal | None:
        """403 unless the key may send at least one of ``kinds`` (ingest refuses the
        events of a batch its key may not send one by one, later)."""
        if key is None or not kinds or any(key.allows(kind) for kind in kinds):
            return None
        return self.refuse(
            Refusal(
                403,
                f"the API key of client {key.client_id!r} may send only "
                f"{', '.join(sorted(key.scopes))}, not {', '.join(sorted(kinds))}",
            )
        )

    def concurrency_refusal(self, key: ApiKey | None, what: str) -> Refusal | None:
        """429 when the key already has its budget of requests in flight here."""
        if key is None or not key.max_concurrency:
            return None
        if self.in_flight[key.key_hash] < key.max_concurrency:
            return None
        return self.refuse(
            Refusal(
                429,
                f"client {key.client_id!r} has {key.max_concurrency} {what} in flight, "
                "its budget: retry when one ends",
                1.0,
            )
        )

    async def rate_refusal(self, key: ApiKey | None, cost: int, what: str) -> Refusal | None:
        """429 when the key's requests per second (shared through Redis) are spent."""
        if key is None or self._limiter is None:
            return None
        wait_s = await self._limiter.take(key, cost)
        if wait_s <= 0:
            return None
        return self.refuse(
            Refusal(
                429,
                f"rate limit of client {key.client_id!r} ({key.rate_per_s:g} {what}/s) spent: "
                f"retry in {wait_s:.2f} s",
                wait_s,
            )
        )

    async def byte_refusal(self, key: ApiKey | None, size: int) -> Refusal | None:
        """429 when the key's event bytes per second (its rate x bytes_per_event, shared
        through Redis) are spent: what it costs the broker, not only how many."""
        if key is None or self._limiter is None:
            return None
        wait_s = await self._limiter.take_bytes(key, size, self._bytes_per_event)
        if wait_s <= 0:
            return None
        return self.refuse(
            Refusal(
                429,
                f"event byte budget of client {key.client_id!r} "
                f"({key.rate_per_s * self._bytes_per_event:,.0f} bytes/s) spent: "
                f"retry in {wait_s:.2f} s",
                wait_s,
            )
        )

    def body_limit(self, key: ApiKey | None) -> int | None:
        """The largest body this request may have (None: no bound here)."""
        bounds = [b for b in (self._max_request_bytes, key and key.max_request_bytes) if b]
        return min(bounds) if bounds else None

    def size_refusal(self, key: ApiKey | None, size: int | None) -> Refusal | None:
        """429 over the key's byte budget, 413 over the server's bound; None for an unknown
        size (a chunked body is held to the same bound while it is read)."""
        limit = self.body_limit(key)
        if size is None or limit is None or size <= limit:
            return None
        if key is not None and key.max_request_bytes and size > key.max_request_bytes:
            return self.refuse(
                Refusal(
                    429,
                    f"a request of {size} bytes is over client {key.client_id!r}'s budget "
                    f"of {key.max_request_bytes} bytes",
                )
            )
        return self.refuse(
            Refusal(
                413,
                f"a request of {size} bytes is over the server's bound of "
                f"{self._max_request_bytes} bytes",
            )
        )

    def tokens_refusal(self, key: ApiKey | None, max_tokens: int) -> Refusal | None:
        """429 when a completion asks for more tokens than the key's budget."""
        if key is None or not key.max_tokens or max_tokens <= key.max_tokens:
            return None
        return self.refuse(
            Refusal(
                429,
                f"max_tokens {max_tokens} is over client {key.client_id!r}'s budget "
                f"of {key.max_tokens} tokens per completion",
            )
        )

    @contextlib.contextmanager
    def serving(self, key: ApiKey | None) -> Iterator[None]:
        """Counts the request in flight for its key while it is served."""
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
