"""One wait for every test: poll what the test can observe (a counter, a beat, a log line,
a file, a query) until it is what the test needs, or fail saying what was awaited and what
was last seen.

A sleep long enough on a quiet machine is too short on a busy one and wasted everywhere
else; waiting on the condition itself is neither. Sleeps that stay in tests are part of
what is tested: a window or a cache's lifetime elapsing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # the client SDK's tests wait too, in virtualenvs without rtrl
    from rtrl import procs

T = TypeVar("T")


@dataclass(frozen=True)
class Watched:
    """A process the awaited condition depends on: the wait fails as soon as it exits
    instead of running out its timeout, and any failure shows the tail of its log."""

    proc: procs.Proc
    log: Path
    tail_chars: int = 3000

    def tail(self) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else "(no log yet)"
        return f"--- {self.proc.name}, {self.log} ---\n{text[-self.tail_chars :]}"


class _Attempt:
    """The deadline and the failure messages shared by the sync and async waits."""

    def __init__(self, what: str, timeout_s: float, watching: Iterable[Watched]) -> None:
        self.what = what
        self.timeout_s = timeout_s
        self.watching = tuple(watching)
        self.deadline = time.monotonic() + timeout_s

    def done(self, accepted: object, value: object) -> bool:
        """True once the value is accepted; raises AssertionError when a watched process
        has exited or the deadline has passed."""
        if accepted:
            return True
        for watched in self.watching:
            if not watched.proc.alive():
                raise AssertionError(
                    f"{watched.proc.name} exited with {watched.proc.popen.returncode} while "
                    f"waiting for {self.what}; last seen: {value!r}{self._tails()}"
                )
        if time.monotonic() > self.deadline:
            raise AssertionError(
                f"gave up after {self.timeout_s:g} s waiting for {self.what}; "
                f"last seen: {value!r}{self._tails()}"
            )
        return False

    def _tails(self) -> str:
        return "".join(f"\n{watched.tail()}" for watched in self.watching)


def at_least(threshold: int) -> Callable[[int], bool]:
    """A ``ready`` for a count that must reach ``threshold``, bound now: inside a loop a
    lambda would close over the loop's variable instead."""
    return lambda count: count >= threshold


def until(
    probe: Callable[[], T],
    what: str,
    *,
    ready: Callable[[T], object] = bool,
    timeout_s: float = 30.0,
    interval_s: float = 0.05,
    watching: Iterable[Watched] = (),
) -> T:
    """Call ``probe`` until ``ready`` accepts its value (by default: the value is truthy)
    and return that value.

    ``what`` names the condition in the failure ("v3 published"); the failure also shows
    the probe's last value, so probe for the value and judge it with ``ready``
    (``until(reader.latest, "v3", ready=lambda v: v >= 3)``) rather than probe a bool.
    ``watching``: processes whose exit fails the wait at once, with their log's tail.
    """
    attempt = _Attempt(what, timeout_s, watching)
    while True:
        value = probe()
        if attempt.done(ready(value), value):
            return value
        time.sleep(interval_s)


async def until_async(
    probe: Callable[[], T],
    what: str,
    *,
    ready: Callable[[T], object] = bool,
    timeout_s: float = 30.0,
    interval_s: float = 0.05,
    watching: Iterable[Watched] = (),
) -> T:
    """``until`` for a test whose condition is met by tasks on its own event loop (an
    in-process server): it waits with ``asyncio.sleep`` so they run. ``probe`` runs on the
    loop, so it must be quick (an attribute, a local Redis read)."""
    attempt = _Attempt(what, timeout_s, watching)
    while True:
        value = probe()
        if attempt.done(ready(value), value):
            return value
        await asyncio.sleep(interval_s)
