"""The join's types (reward_stream/join.py has the logic and the rules): its
configuration, the events it reads, a rollout's pending state, a partition's state and
the outputs of ``step`` and ``tick``. join.py re-exports every name here."""

from __future__ import annotations

import itertools
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Literal, get_args

from rtrl.reward_stream.orphans import OrphanShares

TelemetryKind = Literal["edit_shown", "edit_outcome", "persistence", "followup"]
"""The cases of TelemetryEvent's ``payload`` oneof, each an event kind."""
TELEMETRY_KINDS: frozenset[str] = frozenset(get_args(TelemetryKind))
EventKind = Literal["rollout"] | TelemetryKind

# Which clock settled a rollout: its event-time close, or the wall-clock deadline.
SettleTrigger = Literal["stream_time", "deadline"]

# Why a rollout was dropped: no RolloutRecord within max_wait_ms, the gateway's word that no
# worker served it, or its client's (or everyone's) orphan bytes over their bound.
DropReason = Literal["no_record", "unserved", "evicted"]

MiB = 1024 * 1024

# The input log each kind of event is read from; stream time is tracked per source.
SOURCE: dict[str, str] = {
    "rollout": "rollout",
    "edit_shown": "edit",
    "edit_outcome": "edit",
    "persistence": "persistence",
    "followup": "followup",
}


@dataclass(frozen=True)
class JoinConfig:
    window_ms: int
    """How long after its first event (event time or wall clock) a rollout collects events."""
    grace_ms: int
    """Extra event time allowed for out-of-order events before the event-time close."""
    deadline_slack_ms: int
    """Extra wall-clock time after the window before an idle partition settles anyway."""
    max_wait_ms: int
    """How long a rollout whose RolloutRecord never arrived is kept before it is dropped."""
    settled_ttl_ms: int
    """How long settled rollout ids are remembered to route late events and duplicates."""
    max_future_ms: int = 10 * 60 * 1000
    """How far ahead of the wall clock an event time may be before the event is refused."""
    max_age_ms: int = 30 * 24 * 3600 * 1000
    """How far behind the wall clock an event time may be before the event is refused."""
    orphan_bytes_per_client: int = 8 * MiB
    """Telemetry bytes one client's rollouts without a RolloutRecord may hold, per partition."""
    orphan_bytes: int = 64 * MiB
    """Telemetry bytes all rollouts without a RolloutRecord may hold, per partition."""

    def __post_init__(self) -> None:
        for name in (
            "window_ms",
            "grace_ms",
            "deadline_slack_ms",
            "max_wait_ms",
            "settled_ttl_ms",
            "max_future_ms",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_age_ms <= 0:
            raise ValueError(f"max_age_ms must be > 0, got {self.max_age_ms}")
        if self.grace_ms > self.window_ms:
            raise ValueError(f"grace_ms ({self.grace_ms}) must be <= window_ms ({self.window_ms})")
        if self.max_wait_ms < self.window_ms + max(self.grace_ms, self.deadline_slack_ms):
            raise ValueError("max_wait_ms must cover the window plus grace and deadline slack")
        if not 0 < self.orphan_bytes_per_client <= self.orphan_bytes:
            raise ValueError(
                f"orphan_bytes_per_client ({self.orphan_bytes_per_client}) must be > 0 and "
                f"<= orphan_bytes ({self.orphan_bytes})"
            )


# The per-record types (Event here, the outputs below, Batch and OutRecord in
# runtime.py) are never changed after they are built, but they are not frozen: a frozen
# dataclass costs ~2 us more to build, paid for every record on the joiner's hot path.


@dataclass(slots=True)
class Event:
    """One decoded input record. Produced by codec.decode; consumed by step.

    ``message`` is the protobuf (RolloutRecord for kind "rollout", TelemetryEvent
    otherwise); the join never looks inside it.
    """

    kind: EventKind
    event_id: str
    rollout_id: str
    client_ts_ms: int
    message: object = None
    handle: object = field(default=None, compare=False)
    """The runtime's token for the input record, acknowledged once the outputs this
    event leads to are durable (the join only carries it)."""
    caught_up: bool = field(default=True, compare=False)
    """Whether this was the newest record of its source partition when it was read;
    False while the runtime knows of later records still to come (a backlog)."""
    raw: bytes | None = field(default=None, compare=False, repr=False)
    """The record's value as read, kept for RolloutRecords so their reward can carry
    the rollout without encoding it again (reward_wire.encode_with_rollout)."""
    link: tuple[int, bool] | None = None
    """A RolloutRecord that is one link of an agent's chain: (position, final)."""
    client_id: str = field(default="", compare=False)
    """The client whose key sent it (the gateway's stamp; "" without keys)."""
    size: int = field(default=0, compare=False)
    """Its bytes as read: what holding it costs."""
    unserved: bool = field(default=False, compare=False)
    """The gateway's word that no worker served its rollout (kafka.UNSERVED_HEADER)."""


@dataclass(slots=True)
class Pending:
    """A rollout whose window is still open (or which still lacks its RolloutRecord)."""

    open_ts_ms: int
    first_arrival_ms: int
    rollout: Event | None
    events: list[Event]
    """Telemetry events gathered, in arrival order."""
    event_ids: set[str]
    seq: int = 0
    """Order of first arrival within the partition."""
    chain: dict[int, Event] = field(default_factory=dict)
    """An agent's chain: its link records by position, until the final one and every one
    before it are in (then ``rollout`` is the final link)."""
    client_id: str = ""
    """The client of its first event, whose orphan share it counts against."""
    unserved: bool = False
    """Every event of it so far came with the gateway's word that no worker served it."""

    @property
    def orphan(self) -> bool:
        """No RolloutRecord of it (nor any link of its chain) has arrived yet."""
        return self.rollout is None and not self.chain


@dataclass(frozen=True)
class SettledMark:
    expires_ms: int
    event_ids: AbstractSet[str]


@dataclass(slots=True)
class JoinState:
    """Join state of one partition. See the module docstring for the ownership rule."""

    config: JoinConfig
    stream_time_ms: int = 0
    behind: set[str] = field(default_factory=set)
    """Sources with records still to read, as far as the runtime knows: at start,
    those whose committed offset is short of their end; then per event."""
    source_time_ms: dict[str, int] = field(default_factory=dict)
    """Newest event time read from each source."""
    pending: dict[str, Pending] = field(default_factory=dict)
    """Open windows, in first-arrival order."""
    incomplete: dict[str, Pending] = field(default_factory=dict)
    """Closed windows still waiting for their RolloutRecord (until max_wait_ms)."""
    settled: dict[str, SettledMark] = field(default_factory=dict)
    close_heap: list[tuple[int, int, str]] = field(default_factory=list)
    """(event time its window closes at, seq, rollout_id) of pending rollouts; stale entries are skipped."""
    expiry_heaps: tuple[list[tuple[int, int, str]], list[tuple[int, int, str]]] = field(
        default_factory=lambda: ([], [])
    )
    """(wall-clock, event-time) heaps of (max-wait expiry, seq, rollout_id) of incomplete rollouts."""
    arrivals: itertools.count[int] = field(default_factory=itertools.count)
    orphans: OrphanShares = field(default_factory=OrphanShares)
    """Telemetry bytes held by waiting rollouts without a record, per client and in total."""

    @property
    def waiting(self) -> int:
        """Rollouts not settled yet, open or incomplete."""
        return len(self.pending) + len(self.incomplete)


# Outputs. Produced by step/tick; consumed by the runtime (app.py), which turns
# Settled into a RewardRecord and publishes Late to the .late topic.


@dataclass(slots=True)
class Settled:
    rollout_id: str
    rollout: Event
    events: tuple[Event, ...]
    """Telemetry events joined, in arrival order (the RolloutRecord is ``rollout``)."""
    settled_ts_ms: int
    trigger: SettleTrigger
    links: tuple[Event, ...] = ()
    """An agent's chain: its links before the final one (``rollout``), in order; each
    gets the reward too."""


@dataclass(slots=True)
class Dropped:
    """A rollout dropped without a reward: why in ``reason`` (see DropReason)."""

    rollout_id: str
    events: tuple[Event, ...]
    reason: DropReason = "no_record"


@dataclass(slots=True)
class Late:
    """A new event for a rollout that has already settled (or been dropped)."""

    event: Event


@dataclass(slots=True)
class Duplicate:
    """An event whose event_id this rollout has already seen (a redelivery)."""

    event: Event


@dataclass(slots=True)
class Refused:
    """An event whose event time is outside the window around the wall clock; the
    runtime dead-letters it with ``reason``."""

    event: Event
    reason: str


Output = Settled | Dropped | Late | Duplicate | Refused
