"""The rollout join: every event about one rollout_id, gathered for a window, settled once.

Pure logic, no I/O: ``step(state, event, now_ms)`` feeds one decoded event and
``tick(state, now_ms)`` advances wall-clock time; both return the new state and
the outputs (Settled, Dropped, Late, Duplicate) for the runtime to publish.

Time. Event time is the payload's ``client_ts_ms``; stream time is the largest
event time this partition has seen. A rollout's window opens at the event time of
its first event and it settles when either
  * stream time >= open + window_ms + grace_ms (event time: deterministic on replay), or
  * now_ms >= first arrival (wall clock) + window_ms + deadline_slack_ms, so a
    partition that goes quiet still settles what it holds.
Settling needs the RolloutRecord (a reward without tokens is useless to the
trainer): an expired window without one keeps waiting until max_wait_ms (wall
clock since first arrival, or event time since open) and is then dropped.

State ownership. ``JoinState`` is a frozen dataclass, but the pending and settled
maps inside it are plain dicts that ``step``/``tick`` update in place: copying the
settled-id memory (minutes of rollouts) on every event would dominate the cost.
The functions are pure in spirit under one rule: a state passed in is consumed,
and only the returned state may be used afterwards. Given the same sequence of
(event, now_ms) calls, the outputs are always the same.

Memory. A settled (or dropped) rollout's id and event ids are remembered for
settled_ttl_ms of wall clock, to tell a late event from a redelivered duplicate;
after that its id is forgotten, and an event for it opens a new pending rollout
(which, lacking a RolloutRecord, is eventually dropped).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, Union

EventKind = Literal["rollout", "edit_shown", "edit_outcome", "persistence", "followup"]


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

    def __post_init__(self) -> None:
        for name in ("window_ms", "grace_ms", "deadline_slack_ms", "max_wait_ms", "settled_ttl_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.grace_ms > self.window_ms:
            raise ValueError(f"grace_ms ({self.grace_ms}) must be <= window_ms ({self.window_ms})")
        if self.max_wait_ms < self.window_ms + max(self.grace_ms, self.deadline_slack_ms):
            raise ValueError("max_wait_ms must cover the window plus grace and deadline slack")


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class Pending:
    """A rollout whose window is still open (or which still lacks its RolloutRecord)."""

    open_ts_ms: int
    first_arrival_ms: int
    rollout: Event | None
    events: tuple[Event, ...]
    event_ids: frozenset[str]


@dataclass(frozen=True)
class SettledMark:
    expires_ms: int
    event_ids: frozenset[str]


@dataclass(frozen=True)
class JoinState:
    """Join state of one partition. See the module docstring for the ownership rule."""

    config: JoinConfig
    stream_time_ms: int = 0
    pending: dict[str, Pending] = field(default_factory=dict)
    settled: dict[str, SettledMark] = field(default_factory=dict)


# Outputs. Produced by step/tick; consumed by the runtime (app.py), which turns
# Settled into a RewardRecord and publishes Late to the .late topic.


@dataclass(frozen=True)
class Settled:
    rollout_id: str
    rollout: Event
    events: tuple[Event, ...]
    """Telemetry events joined, in arrival order (the RolloutRecord is ``rollout``)."""
    settled_ts_ms: int
    trigger: Literal["stream_time", "deadline"]


@dataclass(frozen=True)
class Dropped:
    """A rollout whose RolloutRecord never arrived within max_wait_ms."""

    rollout_id: str
    events: tuple[Event, ...]


@dataclass(frozen=True)
class Late:
    """A new event for a rollout that has already settled (or been dropped)."""

    event: Event


@dataclass(frozen=True)
class Duplicate:
    """An event whose event_id this rollout has already seen (a redelivery)."""

    event: Event


Output = Union[Settled, Dropped, Late, Duplicate]


def step(state: JoinState, event: Event, now_ms: int) -> tuple[JoinState, list[Output]]:
    """Feed one event; returns the new state and what to publish (consumes ``state``)."""
    outputs: list[Output] = []
    _forget_expired(state, now_ms)
    rollout_id = event.rollout_id
    mark = state.settled.get(rollout_id)
    pending = state.pending.get(rollout_id)
    if mark is not None:
        outputs.append(Duplicate(event) if event.event_id in mark.event_ids else Late(event))
    elif pending is None:
        state.pending[rollout_id] = Pending(
            open_ts_ms=event.client_ts_ms,
            first_arrival_ms=now_ms,
            rollout=event if event.kind == "rollout" else None,
            events=() if event.kind == "rollout" else (event,),
            event_ids=frozenset((event.event_id,)),
        )
    elif event.event_id in pending.event_ids or (event.kind == "rollout" and pending.rollout is not None):
        # A second RolloutRecord under a new event_id is a producer retry with a fresh
        # id; the first one holds the tokens the trainer will use.
        outputs.append(Duplicate(event))
    elif event.kind == "rollout":
        state.pending[rollout_id] = replace(pending, rollout=event, event_ids=pending.event_ids | {event.event_id})
    else:
        state.pending[rollout_id] = replace(
            pending, events=(*pending.events, event), event_ids=pending.event_ids | {event.event_id}
        )
    state = replace(state, stream_time_ms=max(state.stream_time_ms, event.client_ts_ms))
    outputs.extend(_settle_ready(state, now_ms))
    return state, outputs


def tick(state: JoinState, now_ms: int) -> tuple[JoinState, list[Output]]:
    """Advance wall-clock time only: settles rollouts past their deadline (consumes ``state``)."""
    _forget_expired(state, now_ms)
    return state, _settle_ready(state, now_ms)


def _settle_ready(state: JoinState, now_ms: int) -> list[Output]:
    config = state.config
    # A linear scan: pending holds about (rollouts/s per partition) x window, a few hundred.
    outputs: list[Output] = []
    for rollout_id, pending in list(state.pending.items()):
        by_stream_time = state.stream_time_ms >= pending.open_ts_ms + config.window_ms + config.grace_ms
        by_deadline = now_ms >= pending.first_arrival_ms + config.window_ms + config.deadline_slack_ms
        if not (by_stream_time or by_deadline):
            continue
        if pending.rollout is not None:
            trigger = "stream_time" if by_stream_time else "deadline"
            outputs.append(Settled(rollout_id, pending.rollout, pending.events, now_ms, trigger))
        elif (
            now_ms >= pending.first_arrival_ms + config.max_wait_ms
            or state.stream_time_ms >= pending.open_ts_ms + config.max_wait_ms
        ):
            outputs.append(Dropped(rollout_id, pending.events))
        else:
            continue
        del state.pending[rollout_id]
        state.settled[rollout_id] = SettledMark(now_ms + config.settled_ttl_ms, pending.event_ids)
    return outputs


def _forget_expired(state: JoinState, now_ms: int) -> None:
    # Marks are inserted in settle order with a fixed TTL, so the oldest are first.
    settled = state.settled
    while settled:
        oldest = next(iter(settled))
        if settled[oldest].expires_ms > now_ms:
            break
        del settled[oldest]
