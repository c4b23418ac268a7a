"""What an API key may spend, and what `rtrl keys create` gives one unless told otherwise.

A key's budgets are numbers in its signed record (rtrl/api_keys.py), enforced at the one
door of every listener (rtrl/admission.py): requests per second in a token bucket shared
through Redis (events at the gateway, completions at the serving API: one bucket per key,
so a key with both scopes spends both from it), completions in flight per serving
process, and per-request bounds on bytes and tokens. 0 is no budget of the key's own:
unlimited for the rate and the concurrency, the server's own bound for bytes and tokens.

The defaults are applied when a key is issued and written into its record, never when a
record is read: a record means what the operator signed, so keys issued before these
defaults keep the budgets (none) they were signed with until they are rotated or revoked.

Kept free of Redis and crypto imports: the CLI reads ONE_CLIENT for its ``--help``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


# Produced by the operator (client_budgets, for `rtrl keys create`); consumed by issue_key,
# which signs the numbers into the key's record.
@dataclass(frozen=True)
class Budgets:
    """What one key may spend; each 0 for no budget of the key's own."""

    rate_per_s: float
    """Events (gateway) plus completions (serving API) per second, from one bucket per key."""
    burst: float
    """The most the bucket holds: what may be spent at once after a quiet spell."""
    max_concurrency: int
    """Completions in flight at once, per serving process."""
    max_request_bytes: int = 0
    """The largest request body (0: the server's bound only)."""
    max_tokens: int = 0
    """The most tokens one completion may ask for (0: the server's bound only)."""

    def __post_init__(self) -> None:
        for name, value in self.issue_args().items():
            if value < 0:
                raise ValueError(f"{name} must be >= 0 (0: no budget), got {value}")
        if self.rate_per_s and not self.burst:
            raise ValueError(
                "burst must be > 0 with a rate: it is the most the key may spend at once "
                "(a rate of 0 lifts the rate limit)"
            )

    def issue_args(self) -> dict[str, float | int]:
        """The budgets as issue_key's keyword arguments."""
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """One line for the operator: what the key may spend."""
        rate = (
            f"{self.rate_per_s:g} requests/s (events and completions), bursts of {self.burst:g}"
            if self.rate_per_s
            else "requests/s unlimited"
        )
        in_flight = self.max_concurrency or "unlimited"
        tokens = self.max_tokens or "the server's bound"
        size = f"{self.max_request_bytes} bytes" if self.max_request_bytes else "the server's bound"
        return (
            f"{rate}; completions in flight per server: {in_flight}; "
            f"tokens per completion: {tokens}; request size: {size}"
        )


ONE_CLIENT_BURST_S = 3.0
"""Seconds of the rate a bucket holds when no burst is given: a flurry of edits, or a batch
of events an editor spooled while offline, goes through at once."""

# One editor, as the serving API and the gateway see it. It asks for a completion when its
# user pauses typing: a few a second at the very most, each answered in well under a
# second, so only a few are ever in flight (one per open pane, plus the one it is replacing
# while the server finishes the one it dropped). For each edit it shows it reports two to
# four events (edit_shown, edit_outcome, persistence snapshots, a follow-up). 20 a second
# covers three completions a second and their events, from the one bucket, with room to
# spare; 4 in flight is the handful an editor needs, and a flood on one key then takes 4 of
# an engine batch's 32 rows instead of all of them. Per-request bounds (tokens, bytes) stay
# the server's: the right ones depend on the model served, which the CLI does not know.
ONE_CLIENT = Budgets(rate_per_s=20.0, burst=20.0 * ONE_CLIENT_BURST_S, max_concurrency=4)
"""What `rtrl keys create` (and `rtrl keys rotate` for a client with no key yet) gives a
key unless told otherwise."""


def client_budgets(
    rate_per_s: float | None = None,
    burst: float | None = None,
    max_concurrency: int | None = None,
    max_request_bytes: int | None = None,
    max_tokens: int | None = None,
) -> Budgets:
    """ONE_CLIENT, but for what the operator gave (None: not given; 0: no budget). A burst
    not given is ONE_CLIENT_BURST_S seconds of the rate. Raises ValueError for a negative
    budget, or a rate with a burst of 0."""

    def given(value: float | None, default: float) -> float:
        return default if value is None else value

    rate = given(rate_per_s, ONE_CLIENT.rate_per_s)
    return Budgets(
        rate_per_s=rate,
        burst=given(burst, rate * ONE_CLIENT_BURST_S),
        max_concurrency=int(given(max_concurrency, ONE_CLIENT.max_concurrency)),
        max_request_bytes=int(given(max_request_bytes, ONE_CLIENT.max_request_bytes)),
        max_tokens=int(given(max_tokens, ONE_CLIENT.max_tokens)),
    )
