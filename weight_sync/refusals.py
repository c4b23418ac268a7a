"""The versions a worker would not take, remembered so that it does not fetch them again.

Whoever can write Redis can point an arm's latest at a manifest a worker must refuse
(not the trainer's for this arm, or an old one replayed) and leave it there. A worker
that answers each refusal by starting over from a keyframe is sent the same version
again at once, about ten times a second, until Redis is repaired. So a version is
refused once: by its number and manifest (the same number under another manifest is
another version, and is judged afresh), counted and logged once, then skipped while the
subscription stays open, so weight_sync streams it no more. A version that fails to
decode is different the first time, since the worker's own copy may be what is wrong:
the worker starts over from a keyframe; the second time, the version is refused.

Starting over is the one thing that fetches anew, so it waits a pause that doubles with
each refusal or failure since the last version taken (``RefusalBackoff``), and the next
version taken resets it. The stream cuts a pause short when the arm's latest changes
(stream.py): a valid new version never waits it out.

Pure: no I/O, no clock; the caller sleeps.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from rtrl.v1 import weights_pb2
from rtrl.weight_sync.checksum import xxh3_hex

V = TypeVar("V")
Identity = tuple[str, int, str]
"""A version's arm, number and the hash of its whole manifest (``identity``)."""

FORGED = "forged"
"""Its manifest does not verify as the trainer's for this arm."""
ROLLED_BACK = "rolled_back"
"""Trained to an earlier step than a version already taken: an old version replayed."""
UNDECODABLE = "undecodable"
"""It cannot be decoded: a delta on a refused version, or it failed to decode twice (the
second time from a keyframe)."""


@dataclass(frozen=True)
class RefusalBackoff:
    """How long a worker waits before starting over from a keyframe after refusing."""

    min_s: float = 1.0
    """The first pause."""
    max_s: float = 60.0
    """The longest pause: the doubling stops here."""
    jitter: float = 0.2
    """Up to this fraction of each pause is taken off at random, so that workers refused
    together do not come back together; 0 in tests, where pauses must be exact."""
    remember: int = 1024
    """Refused versions remembered (the oldest forgotten first): bounds the memory an
    attacker writing version after version can make a worker spend."""

    def __post_init__(self) -> None:
        if not 0 < self.min_s <= self.max_s:
            raise ValueError(f"need 0 < min_s <= max_s, got {self.min_s}, {self.max_s}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {self.jitter}")
        if self.remember < 1:
            raise ValueError(f"remember must be >= 1, got {self.remember}")


def identity(manifest: weights_pb2.Manifest) -> Identity:
    """What makes a version the one it is: its arm, number and whole manifest."""
    return (
        manifest.arm,
        manifest.version,
        xxh3_hex(manifest.SerializeToString(deterministic=True)),
    )


class Refusals:
    """The versions one worker refused (shared by the subscribers a worker's follower
    runs one after another) and the pause before its next fresh start.

    ``counts`` has one entry per refused version, by reason (FORGED, ROLLED_BACK,
    UNDECODABLE): a version met again is not counted again."""

    def __init__(
        self,
        backoff: RefusalBackoff | None = None,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.backoff = backoff or RefusalBackoff()
        self._rng = rng
        self._refused: OrderedDict[Identity, str] = OrderedDict()
        self._failed_once: OrderedDict[Identity, None] = OrderedDict()
        self.counts: Counter[str] = Counter()
        self.total = 0
        """Versions refused, each once (read from other threads: a plain int)."""
        self.strikes = 0
        """Refusals and failures (repeats included) since the last version taken."""

    def known(self, manifest: weights_pb2.Manifest) -> bool:
        """Whether this very version was refused before; meeting it again is a strike."""
        key = identity(manifest)
        if key not in self._refused:
            return False
        self._refused.move_to_end(key)
        self.strikes += 1
        return True

    def refuse(self, manifest: weights_pb2.Manifest, reason: str) -> None:
        """Remember the version as refused for ``reason``, and count it."""
        self.strikes += 1
        key = identity(manifest)
        if key not in self._refused:
            self.counts[reason] += 1
            self.total += 1
        self._remember(self._refused, key, reason)

    def failed_to_decode(self, manifest: weights_pb2.Manifest) -> bool:
        """The version did not decode. True the first time: start over from a keyframe;
        False the second: it is refused (UNDECODABLE), and skipped from now on."""
        key = identity(manifest)
        if key in self._failed_once:
            del self._failed_once[key]
            self.refuse(manifest, UNDECODABLE)
            return False
        self.strikes += 1
        self._remember(self._failed_once, key, None)
        return True

    def taken(self) -> None:
        """A version was taken: the next refusal pauses from min_s again."""
        self.strikes = 0

    def pause_s(self) -> float:
        """How long to wait before starting over from a keyframe: 0 with no strike, then
        min_s doubling with each strike up to max_s, less up to ``jitter`` of it."""
        if self.strikes == 0:
            return 0.0
        backoff = self.backoff
        doublings = min(self.strikes - 1, 64)  # 2**64 * min_s is past any max_s
        pause = min(backoff.min_s * 2**doublings, backoff.max_s)
        return pause * (1 - backoff.jitter * self._rng())

    def _remember(self, remembered: OrderedDict[Identity, V], key: Identity, value: V) -> None:
        remembered[key] = value
        remembered.move_to_end(key)
        while len(remembered) > self.backoff.remember:
            remembered.popitem(last=False)
