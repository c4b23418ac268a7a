"""The rollout join: every event about one rollout_id, gathered for a window, settled once.

Pure logic, no I/O: ``step(state, event, now_ms)`` feeds one decoded event and
``tick(state, now_ms)`` advances wall-clock time; both return the new state and
the outputs (Settled, Dropped, Late, Duplicate) for the runtime to publish.

Time. Event time is the payload's ``client_ts_ms``. A partition is fed by four
sources (the rollout, edit, persistence and follow-up topics), and a consumer far
behind reads them unevenly: it can hand over thousands of edit records before the
first RolloutRecord of the same minute. Stream time therefore follows the slowest
source that still has records to read (as Kafka Streams aligns its inputs): each
event says whether it was the newest record of its source when read
(``Event.caught_up``, the runtime's lag hint), and

  * while some sources are behind, stream time is the smallest newest event time
    among those sources (a behind source not read at all yet holds it still);
  * when every source is caught up, it is the largest event time seen;

and it never goes back. A source that is caught up cannot hold stream time back:
whatever it delivers next was produced after now. An event whose event time lies outside
[now_ms - max_age_ms, now_ms + max_future_ms] of the wall clock (a client clock in
the year 2200, 2^62, 0) would drag stream time, and with it every other rollout's
close, along: it is Refused instead, joins nothing, moves no clock, and the runtime
dead-letters it with the reason. A rollout's window opens at the
event time of its first event and it settles when either
  * stream time >= open + window_ms + grace_ms (event time: deterministic on replay), or
  * now_ms >= first arrival (wall clock) + window_ms + deadline_slack_ms, so a
    partition that goes quiet still settles what it holds.
Settling needs the RolloutRecord (a reward without tokens is useless to the
trainer): an expired window without one keeps waiting until max_wait_ms (wall
clock since first arrival, or event time since open) and is then dropped. The wall
clock rules only apply while no source is behind: a partition catching up on a
backlog has its records waiting to be read, and settling on the wall clock would
settle rollouts whose telemetry is simply further down another topic.

State ownership. ``step``/``tick`` update the ``JoinState`` (and the ``Pending``
entries in it) in place: copying the settled-id memory (minutes of rollouts), or
even one pending rollout, on every event would dominate the cost. The functions are
pure in spirit under one rule: a state passed in is consumed, and only the returned
state may be used afterwards. Given the same sequence of (event, now_ms) calls, the
outputs are always the same; the outputs themselves are never changed afterwards.

Cost. Settling must not scan every pending rollout on every event: in a backlog a
partition holds thousands, and a scan per event made the join quadratic. Pending
rollouts are indexed instead: a heap by event-time close, insertion order (= first
arrival, since now_ms never goes back) for the wall-clock deadline, and rollouts
whose window closed without a RolloutRecord wait apart (``incomplete``) in heaps by
their two max-wait expiries. Each event costs O(log n) plus what it settles.
Outputs of one call come out in first-arrival order, as a scan would give them.

Chains. An agent's trajectory may be written as several RolloutRecords under one
rollout_id, the links of its chain (each names its position, the last says it is final:
rtrl/trajectory.py's Link). The rollout is complete once the final link and every link
before it are in; it settles then as one rollout, the final link as its ``rollout`` and
the others as its ``links``, so one reward reaches every link. A link seen twice is a
duplicate, as a second record of a single rollout is.

Rollouts no worker served. Telemetry may name a rollout id no worker ever served (a
client's bug, or one flooding the joiner with 68 KB events about made-up ids). Such a
rollout has no RolloutRecord to wait for, so it must not wait max_wait_ms (the longest
trajectory's). Two rules bound it, in the order they apply:

  * known not to exist: the gateway, which holds the serving API's "served to" marks
    (set before a rollout is answered), stamps an event whose rollout no worker served
    (``Event.unserved``). A rollout all of whose events say so waits only its window,
    as any rollout does for a record that may be read after its first events; if its
    window closes without one it is dropped (``Dropped``, reason "unserved") instead of
    waiting max_wait_ms. One event without the stamp (or any record) makes it an
    ordinary rollout;
  * not known either way (a gateway without keys writes no marks; the stamp is a Kafka
    header, so whoever writes to the broker can strip it): the rollout waits as any other,
    but the telemetry held by rollouts without any RolloutRecord yet (orphans) is bounded,
    per client (``orphan_bytes_per_client``, the gateway's client_id) and in total
    (``orphan_bytes``). Past either bound the oldest orphan of that client (or of all) is
    evicted (``Dropped``, reason "evicted"; over the total, of the client holding the
    most), so a client flooding ids evicts only its own,
    while an honest agent's telemetry (its trajectory's record comes when it ends) waits
    behind it untouched. A rollout with a record in is never an orphan: its telemetry is
    bounded by what a key may send within its window.

Memory. A settled (or dropped) rollout's id and event ids are remembered for
settled_ttl_ms of wall clock, to tell a late event from a redelivered duplicate;
after that its id is forgotten, and an event for it opens a new pending rollout
(which, lacking a RolloutRecord, is eventually dropped).
"""

from __future__ import annotations

import heapq

from rtrl.event_time import EventTimeWindow
from rtrl.reward_stream.join_types import (
    SOURCE,
    TELEMETRY_KINDS,
    Dropped,
    DropReason,
    Duplicate,
    Event,
    EventKind,
    JoinConfig,
    JoinState,
    Late,
    MiB,
    Output,
    Pending,
    Refused,
    Settled,
    SettledMark,
    SettleTrigger,
)

# The types live in join_types.py; every one of them is this module's too.
__all__ = [
    "SOURCE",
    "TELEMETRY_KINDS",
    "Dropped",
    "DropReason",
    "Duplicate",
    "Event",
    "EventKind",
    "JoinConfig",
    "JoinState",
    "Late",
    "MiB",
    "Output",
    "Pending",
    "Refused",
    "Settled",
    "SettledMark",
    "SettleTrigger",
    "skip",
    "step",
    "tick",
]
from rtrl.reward_stream.join_types import (  # re-exported: the join's public types
    TelemetryKind as TelemetryKind,
)


def step(state: JoinState, event: Event, now_ms: int) -> tuple[JoinState, list[Output]]:
    """Feed one event; returns the new state and what to publish (consumes ``state``)."""
    outputs: list[Output] = []
    _forget_expired(state, now_ms)
    config = state.config
    if not now_ms - config.max_age_ms <= event.client_ts_ms <= now_ms + config.max_future_ms:
        return _refuse(state, event, now_ms)
    state = _advance_stream_time(state, event)
    rollout_id = event.rollout_id
    mark = state.settled.get(rollout_id)
    pending = state.pending.get(rollout_id)
    incomplete = state.incomplete.get(rollout_id)
    if mark is not None:
        outputs.append(Duplicate(event) if event.event_id in mark.event_ids else Late(event))
    elif incomplete is not None:
        outputs.extend(_into_incomplete(state, incomplete, event, now_ms))
    elif pending is None:
        pending = _open(state, event, now_ms)
        if event.kind == "rollout":
            _take_rollout(pending, event)
        else:
            outputs.extend(_hold(state, pending, event, now_ms))
    elif event.event_id in pending.event_ids:
        outputs.append(Duplicate(event))
    elif event.kind == "rollout":
        # A second RolloutRecord under a new event_id is a producer retry with a fresh
        # id; the first one holds the tokens the trainer will use.
        if not _take_rollout(pending, event):
            outputs.append(Duplicate(event))
        if not pending.orphan:
            state.orphans.release(rollout_id)
    else:
        pending.events.append(event)
        pending.event_ids.add(event.event_id)
        pending.unserved = pending.unserved and event.unserved
        outputs.extend(_hold(state, pending, event, now_ms))
    outputs.extend(_settle_ready(state, now_ms))
    return state, outputs


def _open(state: JoinState, event: Event, now_ms: int) -> Pending:
    """A new pending rollout whose first event is ``event``, its window open from now."""
    config = state.config
    seq = next(state.arrivals)
    pending = state.pending[event.rollout_id] = Pending(
        open_ts_ms=event.client_ts_ms,
        first_arrival_ms=now_ms,
        rollout=None,
        events=[] if event.kind == "rollout" else [event],
        event_ids={event.event_id},
        seq=seq,
        client_id=event.client_id,
        unserved=event.unserved and event.kind != "rollout",
    )
    heapq.heappush(
        state.close_heap,
        (event.client_ts_ms + config.window_ms + config.grace_ms, seq, event.rollout_id),
    )
    return pending


def _hold(state: JoinState, pending: Pending, event: Event, now_ms: int) -> list[Output]:
    """``event`` joined ``pending``: while that rollout is an orphan its bytes count against
    its client's share and the total, and what is over either is evicted (OrphanShares.over)."""
    if not pending.orphan:
        return []
    shares, config = state.orphans, state.config
    shares.add(event.rollout_id, pending.client_id, event.size)
    evicted: list[Output] = []
    while victim := shares.over(
        pending.client_id, config.orphan_bytes_per_client, config.orphan_bytes
    ):
        evicted.append(_evict(state, victim, now_ms))
    return evicted


def _evict(state: JoinState, rollout_id: str, now_ms: int) -> Dropped:
    """Drop an orphan over the bounds, remembered as settled (its later events are late)."""
    orphan = state.pending.pop(rollout_id, None) or state.incomplete.pop(rollout_id)
    state.orphans.release(rollout_id)
    state.settled[rollout_id] = SettledMark(now_ms + state.config.settled_ttl_ms, orphan.event_ids)
    return Dropped(rollout_id, tuple(orphan.events), "evicted")


def _into_incomplete(
    state: JoinState, incomplete: Pending, event: Event, now_ms: int
) -> list[Output]:
    """An event for a rollout whose window closed while it waited for its RolloutRecord
    (or, for a chain, its final link and every one before it): it settles at once when
    the record completes it."""
    if event.event_id in incomplete.event_ids:
        return [Duplicate(event)]
    if event.kind != "rollout":
        incomplete.events.append(event)
        incomplete.event_ids.add(event.event_id)
        return _hold(state, incomplete, event, now_ms)
    if not _take_rollout(incomplete, event):
        return [Duplicate(event)]
    state.orphans.release(event.rollout_id)
    if incomplete.rollout is None:
        return []
    config = state.config
    del state.incomplete[event.rollout_id]
    closed = state.stream_time_ms >= incomplete.open_ts_ms + config.window_ms + config.grace_ms
    trigger: SettleTrigger = "stream_time" if closed else "deadline"
    state.settled[event.rollout_id] = SettledMark(
        now_ms + config.settled_ttl_ms, incomplete.event_ids
    )
    return [_settled(incomplete, now_ms, trigger)]


def _refuse(state: JoinState, event: Event, now_ms: int) -> tuple[JoinState, list[Output]]:
    """``event`` is out of the event-time window: it only says how far its source has been read."""
    window = EventTimeWindow(state.config.max_future_ms, state.config.max_age_ms)
    reason = f"client_ts_ms {window.problem(event.client_ts_ms, now_ms, 'joiner clock')}"
    state = _read_from(state, SOURCE[event.kind], event.caught_up)
    return state, [Refused(event, reason), *_settle_ready(state, now_ms)]


def _advance_stream_time(state: JoinState, event: Event) -> JoinState:
    source = SOURCE[event.kind]
    source_time = state.source_time_ms
    if event.client_ts_ms > source_time.get(source, -1):
        source_time[source] = event.client_ts_ms
    return _read_from(state, source, event.caught_up)


def _read_from(state: JoinState, source: str, caught_up: bool) -> JoinState:
    """A record of ``source`` was read: mark whether the source is behind, move stream time."""
    if caught_up:
        state.behind.discard(source)
    else:
        state.behind.add(source)
    source_time = state.source_time_ms
    if state.behind:
        candidate = min(source_time.get(s, -1) for s in state.behind)
    else:
        candidate = max(source_time.values(), default=-1)
    if candidate > state.stream_time_ms:
        state.stream_time_ms = candidate
    return state


def skip(
    state: JoinState, source: str, caught_up: bool, now_ms: int
) -> tuple[JoinState, list[Output]]:
    """A record of ``source`` was read that the join never sees (malformed or private):
    it still says how far that source has been read (consumes ``state``)."""
    state = _read_from(state, source, caught_up)
    return state, _settle_ready(state, now_ms)


def tick(state: JoinState, now_ms: int) -> tuple[JoinState, list[Output]]:
    """Advance wall-clock time only: settles rollouts past their deadline (consumes ``state``)."""
    _forget_expired(state, now_ms)
    return state, _settle_ready(state, now_ms)


def _settle_ready(state: JoinState, now_ms: int) -> list[Output]:
    config = state.config
    closing: dict[str, SettleTrigger] = {}
    # Event-time closes: the heap's stale entries (settled rollouts) are skipped.
    while state.close_heap and state.close_heap[0][0] <= state.stream_time_ms:
        _, seq, rollout_id = heapq.heappop(state.close_heap)
        pending = state.pending.get(rollout_id)
        if pending is not None and pending.seq == seq:
            closing[rollout_id] = "stream_time"
    # Wall-clock deadlines (not while catching up): pending is in first-arrival order,
    # so the due ones are a prefix.
    for rollout_id, pending in () if state.behind else state.pending.items():
        if now_ms < pending.first_arrival_ms + config.window_ms + config.deadline_slack_ms:
            break
        closing.setdefault(rollout_id, "deadline")
    outputs: list[tuple[int, Output]] = []
    for rollout_id, trigger in closing.items():
        pending = state.pending.pop(rollout_id)
        if pending.rollout is not None:
            outputs.append((pending.seq, _settled(pending, now_ms, trigger)))
            state.settled[rollout_id] = SettledMark(
                now_ms + config.settled_ttl_ms, pending.event_ids
            )
        elif pending.unserved and pending.orphan:
            state.orphans.release(rollout_id)
            outputs.append((pending.seq, Dropped(rollout_id, tuple(pending.events), "unserved")))
            state.settled[rollout_id] = SettledMark(
                now_ms + config.settled_ttl_ms, pending.event_ids
            )
        else:
            state.incomplete[rollout_id] = pending
            by_wall, by_event = state.expiry_heaps
            heapq.heappush(
                by_wall, (pending.first_arrival_ms + config.max_wait_ms, pending.seq, rollout_id)
            )
            heapq.heappush(
                by_event, (pending.open_ts_ms + config.max_wait_ms, pending.seq, rollout_id)
            )
    # Incomplete rollouts whose RolloutRecord never came, on either clock (the wall
    # clock only while no source is behind).
    wall_clock = -1 if state.behind else now_ms
    for heap, clock in zip(state.expiry_heaps, (wall_clock, state.stream_time_ms), strict=True):
        while heap and heap[0][0] <= clock:
            _, seq, rollout_id = heapq.heappop(heap)
            incomplete = state.incomplete.get(rollout_id)
            if incomplete is not None and incomplete.seq == seq:
                del state.incomplete[rollout_id]
                state.orphans.release(rollout_id)
                links = tuple(incomplete.chain.values())  # acknowledged with the events
                outputs.append((seq, Dropped(rollout_id, (*incomplete.events, *links))))
                state.settled[rollout_id] = SettledMark(
                    now_ms + config.settled_ttl_ms, incomplete.event_ids
                )
    outputs.sort(key=lambda pair: pair[0])
    return [output for _, output in outputs]


def _take_rollout(pending: Pending, event: Event) -> bool:
    """Add a RolloutRecord to ``pending``; False when it is a duplicate (one record per
    rollout, one per position of a chain). A chain's rollout is its final link, once
    every link up to it is in."""
    if pending.rollout is not None:
        return False
    if event.link is not None:
        position, _ = event.link
        if position in pending.chain:
            return False
        pending.chain[position] = event
        final = next((p for p, e in pending.chain.items() if e.link and e.link[1]), None)
        if final is None or any(p not in pending.chain for p in range(final + 1)):
            pending.event_ids.add(event.event_id)
            return True
        event = pending.chain.pop(final)
    pending.rollout = event
    pending.event_ids.add(event.event_id)
    return True


def _settled(pending: Pending, now_ms: int, trigger: SettleTrigger) -> Settled:
    assert pending.rollout is not None
    links = tuple(pending.chain[p] for p in sorted(pending.chain))
    rollout_id = pending.rollout.rollout_id
    return Settled(rollout_id, pending.rollout, tuple(pending.events), now_ms, trigger, links)


def _forget_expired(state: JoinState, now_ms: int) -> None:
    # Marks are inserted in settle order with a fixed TTL, so the oldest are first.
    settled = state.settled
    while settled:
        oldest = next(iter(settled))
        if settled[oldest].expires_ms > now_ms:
            break
        del settled[oldest]
