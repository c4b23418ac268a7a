"""Event time where it enters: a client's clock is trusted only within a window around ours.

Every service that takes an event time from outside (the serving API's and the
gateway's ``client_ts_ms``, the joiner's input records) accepts it only when

    now_ms - max_age_ms <= ts_ms <= now_ms + max_future_ms

An allow-list: zero, negative, far-past and far-future values (year 2200, 2^62,
2^63 - 1) all fall outside it. Python ints do not overflow, so the check itself
cannot fail on any int64.
"""

from __future__ import annotations

from dataclasses import dataclass

_UNITS = ((24 * 3600 * 1000, "day"), (3600 * 1000, "hour"), (60 * 1000, "minute"), (1000, "second"))


@dataclass(frozen=True)
class EventTimeWindow:
    max_future_ms: int
    """How far an event time may be ahead of the receiver's clock (clock skew)."""
    max_age_ms: int
    """How far an event time may be behind the receiver's clock."""

    def __post_init__(self) -> None:
        if self.max_future_ms < 0 or self.max_age_ms <= 0:
            raise ValueError(
                f"max_future_ms must be >= 0 and max_age_ms > 0, got {self.max_future_ms} and {self.max_age_ms}"
            )

    @classmethod
    def of_seconds(cls, max_future_s: float, max_age_s: float) -> EventTimeWindow:
        return cls(round(max_future_s * 1000), round(max_age_s * 1000))

    def problem(self, ts_ms: int, now_ms: int, clock: str) -> str | None:
        """Why ``ts_ms`` is out of the window around ``now_ms`` (the ``clock`` named in
        the reason, e.g. "gateway clock"), or None when it is inside."""
        if ts_ms > now_ms + self.max_future_ms:
            return (
                f"{ts_ms} is more than {duration(self.max_future_ms)} after the {clock} ({now_ms})"
            )
        if ts_ms < now_ms - self.max_age_ms:
            return f"{ts_ms} is more than {duration(self.max_age_ms)} before the {clock} ({now_ms})"
        return None


def duration(ms: int) -> str:
    """``604800000`` -> "7 days", ``300000`` -> "5 minutes", ``1500`` -> "1500 ms"."""
    for unit_ms, name in _UNITS:
        if ms and ms % unit_ms == 0:
            count = ms // unit_ms
            return f"{count} {name}{'s' if count != 1 else ''}"
    return f"{ms} ms"
