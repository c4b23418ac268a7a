"""An agent's keys and values, kept between its turns by the embedded engine.

Without them every turn of a trajectory prefills its whole history again: at the 20th turn
of 200 tokens, 4,000 positions to serve 200 new ones. A request that names a session
(``SequenceParams.session``: its trajectory's link, inference/sessions.py) leaves its row's
keys and values here when it finishes, under the ids they were computed for (its prompt
and every sampled token but the last, which was never fed). The session's next request,
whose prompt extends those ids, has them copied back into its row and prefills only the
rest (model.prefill from ``start``).

Versions. Kept keys and values were computed under one version (or, under the "keep" swap
policy, across a swap: then under several). When the arm serves another version by the
next turn, the swap policy decides, as it does for a running row: "keep" reuses them
(the turn's tokens attend to an older version's context, as after a swap mid-turn), and
"recompute" prefills the whole history again under the new weights.

Bounded: at most ``max_tokens`` positions are kept in all; the least recently used
session's go first (its next turn prefills in full: slower, never wrong). Only the fast
path's SlotCache keeps sessions; transformers' forward prefills every turn in full.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

MIXED = -1
"""The version of keys and values computed across a swap (under "keep")."""


@dataclass(frozen=True)
class Parked:
    """A session's keys and values: positions [0, len(ids)) of a row."""

    ids: tuple[int, ...]
    k: torch.Tensor
    """[layers, kv_heads, head_dim, positions], as SlotCache keeps keys."""
    v: torch.Tensor
    """[layers, kv_heads, positions, head_dim]."""
    version: int
    """The version that computed them, MIXED across a swap."""


class SessionKV:
    """Kept sessions of one arm. ``park``/``take`` run on the engine thread; ``forget``
    on any (a lock guards the table)."""

    def __init__(self, max_tokens: int, *, reuse_across_versions: bool) -> None:
        self.max_tokens = max_tokens
        self.reuse_across_versions = reuse_across_versions
        """The "keep" swap policy: reuse keys and values an older version computed."""
        self._kept: OrderedDict[str, Parked] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()
        self.hits = 0
        """Turns that resumed from kept keys and values."""
        self.reused = 0
        """Positions those turns did not prefill again."""

    @property
    def tokens(self) -> int:
        return self._tokens

    def park(self, session: str, parked: Parked) -> None:
        if len(parked.ids) > self.max_tokens:
            return
        with self._lock:
            self._drop(session)
            self._kept[session] = parked
            self._tokens += len(parked.ids)
            while self._tokens > self.max_tokens:
                self._drop(next(iter(self._kept)))

    def take(self, session: str, prompt_ids: tuple[int, ...], version: int) -> Parked | None:
        """The session's keys and values if ``prompt_ids`` extends their ids and they may
        serve ``version``; the session keeps nothing after (its request parks anew)."""
        with self._lock:
            parked = self._kept.get(session)
            self._drop(session)
        if parked is None:
            return None
        n = len(parked.ids)
        if n >= len(prompt_ids) or prompt_ids[:n] != parked.ids:
            return None
        if parked.version != version and not self.reuse_across_versions:
            return None
        self.hits += 1
        self.reused += n
        return parked

    def forget(self, session: str) -> None:
        with self._lock:
            self._drop(session)

    def _drop(self, session: str) -> None:
        parked = self._kept.pop(session, None)
        if parked is not None:
            self._tokens -= len(parked.ids)
