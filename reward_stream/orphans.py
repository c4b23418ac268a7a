"""What the joiner's orphans hold, per client and in total: the bookkeeping behind the
join's bounds on rollouts without a RolloutRecord (reward_stream/join.py, "Rollouts no
worker served").

An orphan is a waiting rollout of which no RolloutRecord (nor any link of its chain) has
arrived: telemetry that may be about an agent's open trajectory, or about nothing at all.
Its bytes count against the client of its first event (the gateway's stamp of the key)
until a record of it arrives or it leaves the join. Pure bookkeeping: which rollout to
evict is decided here, evicting it is the join's.

Produced and consumed by join.py alone (one per JoinState, so one per partition).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class OrphanShares:
    """Telemetry bytes held by orphans, by rollout and by client, in first-arrival order."""

    held: dict[str, tuple[str, int]] = field(default_factory=dict)
    """rollout_id -> (its client, telemetry bytes it holds)."""
    by_client: dict[str, dict[str, None]] = field(default_factory=dict)
    """client_id -> its orphans' rollout ids, oldest first."""
    client_bytes: dict[str, int] = field(default_factory=dict)
    total: int = 0

    def add(self, rollout_id: str, client: str, size: int) -> None:
        """``size`` more bytes held by the orphan ``rollout_id`` of ``client``."""
        _, held = self.held.get(rollout_id, (client, 0))
        self.held[rollout_id] = (client, held + size)
        self.by_client.setdefault(client, {})[rollout_id] = None
        self.client_bytes[client] = self.client_bytes.get(client, 0) + size
        self.total += size

    def release(self, rollout_id: str) -> None:
        """``rollout_id`` holds nothing here any more (a record of it came, or it left the
        join); a no-op for a rollout never counted."""
        found = self.held.pop(rollout_id, None)
        if found is None:
            return
        client, size = found
        self.total -= size
        self.client_bytes[client] -= size
        ids = self.by_client[client]
        del ids[rollout_id]
        if not ids:
            del self.by_client[client], self.client_bytes[client]

    def over(self, client: str, per_client: int, in_total: int) -> str | None:
        """The orphan to evict next, or None within both bounds: past ``client``'s share,
        its own oldest; past the total, the oldest of the client holding the most, so a
        client within its share loses nothing to one that floods."""
        if self.client_bytes.get(client, 0) > per_client:
            return next(iter(self.by_client[client]))
        if self.total > in_total:
            largest = max(self.client_bytes, key=self.client_bytes.__getitem__)
            return next(iter(self.by_client[largest]))
        return None
