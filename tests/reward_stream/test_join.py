"""The rollout join as a table of cases: events (kind, event_id, rollout_id, client_ts_ms,
payload) fed at wall-clock times ``now``, wall-clock ticks, and the outputs expected.

Every case uses window 1000 ms, grace 200 ms, deadline slack 500 ms, max wait 5000 ms
and settled TTL 10000 ms. Event time closes a window at open + 1200; the wall-clock
deadline at first arrival + 1500.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import pytest

from rtrl import topics
from rtrl.reward_stream import join, reward
from rtrl.reward_stream.runtime import Joiner
from rtrl.v1 import reward_pb2, rollout_pb2
from rtrl_client.v1 import telemetry_pb2

CONFIG = join.JoinConfig(
    window_ms=1000, grace_ms=200, deadline_slack_ms=500, max_wait_ms=5000, settled_ttl_ms=10000
)


@dataclass(frozen=True)
class E:
    """Feed one event at wall-clock ``now``."""

    kind: str
    event_id: str
    rollout_id: str
    ts: int
    now: int
    payload: str = ""
    caught_up: bool = True
    """False: the runtime knew of later records on this event's source (a backlog)."""
    link: tuple[int, bool] | None = None
    """A rollout record that is a link of an agent's chain: (position, final)."""


@dataclass(frozen=True)
class T:
    """Advance the wall clock only."""

    now: int


def message(e: E):
    if e.kind == "rollout":
        return rollout_pb2.RolloutRecord(
            event_id=e.event_id,
            rollout_id=e.rollout_id,
            client_ts_ms=e.ts,
            completion_text=e.payload,
        )
    payloads: dict[str, Callable[[], dict[str, Any]]] = {
        "edit_shown": lambda: {"edit_shown": telemetry_pb2.EditShown(edit_text=e.payload)},
        "edit_outcome": lambda: {
            "edit_outcome": telemetry_pb2.EditOutcome(
                outcome=telemetry_pb2.EditOutcome.OUTCOME_ACCEPTED
            )
        },
        "persistence": lambda: {
            "persistence": telemetry_pb2.PersistenceSnapshot(region_text=e.payload)
        },
        "followup": lambda: {"followup": telemetry_pb2.FollowUp(message=e.payload)},
    }
    return telemetry_pb2.TelemetryEvent(
        event_id=e.event_id, rollout_id=e.rollout_id, client_ts_ms=e.ts, **payloads[e.kind]()
    )


def summarize(output: join.Output) -> tuple:
    if isinstance(output, join.Settled):
        # Event.message is an object; a settled rollout's events carry TelemetryEvents.
        defaulted = reward.is_defaulted(
            [cast(telemetry_pb2.TelemetryEvent, e.message) for e in output.events]
        )
        event_ids = tuple(sorted([output.rollout.event_id, *(e.event_id for e in output.events)]))
        settled = (
            "settled",
            output.rollout_id,
            output.trigger,
            "defaulted" if defaulted else "observed",
            event_ids,
        )
        links = tuple(e.event_id for e in output.links)
        return (*settled, links) if links else settled
    if isinstance(output, join.Dropped):
        return ("dropped", output.rollout_id)
    if isinstance(output, join.Late):
        return ("late", output.event.event_id)
    return ("duplicate", output.event.event_id)


CASES = {
    # Another rollout's event pushes stream time to open + window + grace (1000+1200):
    # 2199 is not enough, 2200 settles r1 with everything it gathered.
    "settles_on_stream_time": (
        [
            E("rollout", "a1", "r1", 1000, now=0),
            E("edit_shown", "a2", "r1", 1100, now=10),
            E("persistence", "a3", "r1", 1500, now=20),
            E("edit_shown", "b1", "r2", 2199, now=30),
            E("edit_shown", "b2", "r2", 2200, now=40),
        ],
        [(4, ("settled", "r1", "stream_time", "observed", ("a1", "a2", "a3")))],
    ),
    # Nothing else arrives on the partition: the wall-clock deadline (first arrival
    # + window + slack) settles it on a tick, with defaults since no user signal came.
    "idle_partition_settles_by_tick": (
        [E("rollout", "a1", "r1", 1000, now=100), T(1599), T(1600)],
        [(2, ("settled", "r1", "deadline", "defaulted", ("a1",)))],
    ),
    # Redelivered events (same event_id) are dropped, also a redelivered RolloutRecord.
    "duplicates_dropped": (
        [
            E("rollout", "a1", "r1", 1000, now=0),
            E("followup", "a2", "r1", 1100, now=10, payload="thanks"),
            E("followup", "a2", "r1", 1100, now=20, payload="thanks"),
            E("rollout", "a1", "r1", 1000, now=30),
            T(1500),
        ],
        [
            (2, ("duplicate", "a2")),
            (3, ("duplicate", "a1")),
            (4, ("settled", "r1", "deadline", "observed", ("a1", "a2"))),
        ],
    ),
    # A second RolloutRecord under a fresh event_id is a retry: the first one is kept.
    "second_rollout_record_is_duplicate": (
        [E("rollout", "a1", "r1", 1000, now=0), E("rollout", "a9", "r1", 1001, now=5), T(1500)],
        [(1, ("duplicate", "a9")), (2, ("settled", "r1", "deadline", "defaulted", ("a1",)))],
    ),
    # After settling, a new event is late; a redelivery of a joined event is a duplicate.
    "late_and_redelivered_after_settle": (
        [
            E("rollout", "a1", "r1", 1000, now=0),
            T(1500),
            E("followup", "a2", "r1", 1900, now=1600, payload="no, wrong"),
            E("rollout", "a1", "r1", 1000, now=1700),
        ],
        [
            (1, ("settled", "r1", "deadline", "defaulted", ("a1",))),
            (2, ("late", "a2")),
            (3, ("duplicate", "a1")),
        ],
    ),
    # Within the grace period an out-of-order event still joins: r2 moves stream time
    # to 2100 (< 2200), then r1's older persistence snapshot arrives and is joined.
    "out_of_order_within_grace": (
        [
            E("rollout", "a1", "r1", 1000, now=0),
            E("rollout", "b1", "r2", 2100, now=10),
            E("persistence", "a2", "r1", 1050, now=20),
            E("edit_shown", "b2", "r2", 2200, now=30),
        ],
        [(3, ("settled", "r1", "stream_time", "observed", ("a1", "a2")))],
    ),
    # The window opens at the first event, whatever its kind: r1's follow-up at 1000
    # opens it, so the RolloutRecord at 1900 does not move the close beyond 2200.
    "window_opens_at_first_event": (
        [
            E("followup", "a1", "r1", 1000, now=0, payload="thanks"),
            E("rollout", "a2", "r1", 1900, now=10),
            E("edit_shown", "b1", "r2", 2200, now=20),
        ],
        [(2, ("settled", "r1", "stream_time", "observed", ("a1", "a2")))],
    ),
    # The window expired without a RolloutRecord: keep waiting; when the record comes
    # it settles at once (its deadline has passed) with the events gathered meanwhile.
    "missing_rollout_record_waits": (
        [
            E("edit_shown", "a1", "r1", 1000, now=0),
            T(1500),
            E("persistence", "a2", "r1", 2000, now=2000),
            T(2500),
            E("rollout", "a3", "r1", 1100, now=3000),
        ],
        [(4, ("settled", "r1", "deadline", "observed", ("a1", "a2", "a3")))],
    ),
    # No RolloutRecord within max wait (wall clock): dropped, and later events are late.
    "missing_rollout_record_dropped_by_wall_clock": (
        [
            E("edit_shown", "a1", "r1", 1000, now=0),
            T(4999),
            T(5000),
            E("rollout", "a2", "r1", 1100, now=5100),
        ],
        [(2, ("dropped", "r1")), (3, ("late", "a2"))],
    ),
    # ... or by event time: stream time reaching open + max wait drops it too.
    "missing_rollout_record_dropped_by_stream_time": (
        [E("edit_shown", "a1", "r1", 1000, now=0), E("rollout", "b1", "r2", 6000, now=10)],
        [(1, ("dropped", "r1"))],
    ),
    # An agent's chain: links under one rollout_id. It settles once the final link and
    # every link before it are in, whichever order they come in; a link seen twice is a
    # duplicate; the earlier links ride along with the final one.
    "chain_settles_when_complete": (
        [
            E("rollout", "l2", "r1", 1000, now=0, link=(2, True)),
            E("rollout", "l0", "r1", 1001, now=10, link=(0, False)),
            E("followup", "f1", "r1", 1002, now=20, payload="thanks"),
            T(1600),  # the deadline passes: link 1 is still missing
            E("rollout", "l0", "r1", 1001, now=1700, link=(0, False)),
            E("rollout", "l0b", "r1", 1001, now=1800, link=(0, False)),
            E("rollout", "l1", "r1", 1003, now=1900, link=(1, False)),
        ],
        [
            (4, ("duplicate", "l0")),
            (5, ("duplicate", "l0b")),
            (6, ("settled", "r1", "deadline", "observed", ("f1", "l2"), ("l0", "l1"))),
        ],
    ),
    # A chain whose final link never comes is dropped at max wait, like a rollout whose
    # record never came (its links are acknowledged with it).
    "chain_without_final_link_dropped": (
        [E("rollout", "l0", "r1", 1000, now=0, link=(0, False)), T(5000)],
        [(1, ("dropped", "r1"))],
    ),
    # A one-link chain is final at once: it settles as a single rollout does.
    "one_link_chain": (
        [E("rollout", "l0", "r1", 1000, now=0, link=(0, True)), T(1500)],
        [(1, ("settled", "r1", "deadline", "defaulted", ("l0",)))],
    ),
    # Settled ids are remembered for the TTL only: at settle time + 10000 the id is
    # forgotten and a new event opens a fresh pending rollout (which has no record).
    "settled_ids_forgotten_after_ttl": (
        [
            E("rollout", "a1", "r1", 1000, now=0),
            T(1500),
            E("followup", "a2", "r1", 1600, now=11499, payload="thanks"),
            E("followup", "a3", "r1", 1700, now=11500, payload="thanks"),
            T(16500),
        ],
        [
            (1, ("settled", "r1", "deadline", "defaulted", ("a1",))),
            (2, ("late", "a2")),
            (4, ("dropped", "r1")),
        ],
    ),
    # Several rollouts due at once settle in first-arrival order, each exactly once.
    "many_due_on_one_tick": (
        [
            E("rollout", "c1", "r3", 1000, now=0),
            E("rollout", "a1", "r1", 1000, now=1),
            E("edit_outcome", "a2", "r1", 1001, now=2),
            E("rollout", "b1", "r2", 1000, now=3),
            T(2000),
            T(3000),
        ],
        [
            (4, ("settled", "r3", "deadline", "defaulted", ("c1",))),
            (4, ("settled", "r1", "deadline", "observed", ("a1", "a2"))),
            (4, ("settled", "r2", "deadline", "defaulted", ("b1",))),
        ],
    ),
}


def run_case(steps, behind=()) -> list[tuple]:
    state = join.JoinState(CONFIG, behind=set(behind))
    got: list[tuple[int, tuple]] = []
    for index, item in enumerate(steps):
        if isinstance(item, T):
            state, outputs = join.tick(state, item.now)
        else:
            event = join.Event(
                item.kind,
                item.event_id,
                item.rollout_id,
                item.ts,
                message(item),
                caught_up=item.caught_up,
                link=item.link,
            )
            state, outputs = join.step(state, event, item.now)
        got.extend((index, summarize(o)) for o in outputs)
    return got


@pytest.mark.parametrize("steps, expected", CASES.values(), ids=CASES.keys())
def test_join_cases(steps, expected):
    assert run_case(steps) == expected


# A worker far behind reads its sources unevenly. Here the rollout topic of a partition
# is read well ahead of the persistence topic; both start behind (``behind``: what the
# runtime knows from committed vs end offsets when it takes the partition over).
ROLLOUTS_FIRST = [
    E("rollout", "a1", "r1", 1000, now=0, caught_up=False),
    E("rollout", "b1", "r2", 1500, now=1, caught_up=False),
    E("rollout", "c1", "r3", 6000, now=2),
    T(9000),
    E("persistence", "a2", "r1", 1010, now=9001, caught_up=False, payload="x = 1"),
    E("persistence", "b2", "r2", 1510, now=9002, caught_up=False, payload="x = 1"),
    E("persistence", "c2", "r3", 6010, now=9003, payload="x = 1"),
    T(20000),
]

BACKLOG_CASES = {
    # Stream time waits for the slower source, and the wall clock (9000 is far past
    # every deadline) does not settle anything while a source is behind: every rollout
    # settles with its snapshot, r1 and r2 on stream time once the snapshots catch up,
    # r3 on its long-past deadline as soon as nothing is behind.
    "slowest_source_holds_stream_time": (
        ROLLOUTS_FIRST,
        {"rollout", "persistence"},
        [
            (6, ("settled", "r1", "stream_time", "observed", ("a1", "a2"))),
            (6, ("settled", "r2", "stream_time", "observed", ("b1", "b2"))),
            (6, ("settled", "r3", "deadline", "observed", ("c1", "c2"))),
        ],
    ),
    # The same reads without lag hints: the rollout topic alone moves stream time to
    # 6000, r1 and r2 settle with defaults and their snapshots come too late. This is
    # what the hints are for.
    "without_hints_a_backlog_settles_early": (
        [
            E(e.kind, e.event_id, e.rollout_id, e.ts, e.now, e.payload) if isinstance(e, E) else e
            for e in ROLLOUTS_FIRST
        ],
        set(),
        [
            (2, ("settled", "r1", "stream_time", "defaulted", ("a1",))),
            (2, ("settled", "r2", "stream_time", "defaulted", ("b1",))),
            (3, ("settled", "r3", "deadline", "defaulted", ("c1",))),
            (4, ("late", "a2")),
            (5, ("late", "b2")),
            (6, ("late", "c2")),
        ],
    ),
    # A source behind that has not delivered anything yet holds stream time still,
    # however far ahead the others are (the first RolloutRecord may be minutes down the log).
    "unread_source_holds_stream_time": (
        [
            E("edit_shown", "a1", "r1", 1000, now=0),
            E("edit_shown", "b1", "r2", 60000, now=1),
            T(40000),
            E("rollout", "a2", "r1", 1001, now=40001, caught_up=False),
            E("rollout", "b2", "r2", 60001, now=40002),
        ],
        {"rollout"},
        [
            (4, ("settled", "r1", "stream_time", "defaulted", ("a1", "a2"))),
            (4, ("settled", "r2", "deadline", "defaulted", ("b1", "b2"))),
        ],
    ),
    # Once the last source catches up, the wall clock counts again: r1 (deadline
    # 1500) settles on the first call after that, not before.
    "deadline_resumes_when_caught_up": (
        [
            E("rollout", "a1", "r1", 1000, now=0),
            T(5000),
            E("followup", "b1", "r2", 1001, now=5001, caught_up=False, payload="thanks"),
            T(6000),
            E("followup", "b2", "r2", 1002, now=6001, payload="thanks"),
        ],
        {"followup"},
        [(4, ("settled", "r1", "deadline", "defaulted", ("a1",)))],
    ),
    # A RolloutRecord far down its topic is not given up by the wall clock while
    # catching up (max wait 5000 has long passed at 9000); it joins when read, and the
    # rollout settles on its deadline (stream time 1001 has not closed the window).
    "no_wall_clock_drop_while_catching_up": (
        [
            E("persistence", "a1", "r1", 1000, now=0, payload="x = 1"),
            T(9000),
            E("rollout", "a2", "r1", 1001, now=9001),
        ],
        {"rollout"},
        [(2, ("settled", "r1", "deadline", "observed", ("a1", "a2")))],
    ),
}


@pytest.mark.parametrize(
    "steps, behind, expected", BACKLOG_CASES.values(), ids=BACKLOG_CASES.keys()
)
def test_backlog_cases(steps, behind, expected):
    assert run_case(steps, behind) == expected


def test_grace_longer_than_window_is_rejected():
    with pytest.raises(ValueError, match="grace_ms"):
        join.JoinConfig(
            window_ms=1000, grace_ms=1001, deadline_slack_ms=0, max_wait_ms=5000, settled_ttl_ms=0
        )


@pytest.mark.guarantee(5)
def test_joiner_routes_garbage_to_dlq_and_drops_privacy_mode():
    joiner = Joiner(CONFIG)
    [dead] = joiner.feed(topics.EDIT, 2, 7, b"r1", b"\xff\xff\xff not protobuf", now_ms=0)
    assert dead.topic == topics.REWARD_DLQ and dead.value == b"\xff\xff\xff not protobuf"
    assert dict(dead.headers)["error"].startswith(b"protobuf decode failed")
    private = telemetry_pb2.TelemetryEvent(
        event_id="p1",
        rollout_id="r1",
        client_ts_ms=5,
        privacy_mode=True,
        followup=telemetry_pb2.FollowUp(message="x"),
    )
    assert joiner.feed(topics.FOLLOWUP, 2, 8, b"r1", private.SerializeToString(), now_ms=0) == []
    wrong_topic = telemetry_pb2.TelemetryEvent(
        event_id="w1", rollout_id="r1", client_ts_ms=5, followup=telemetry_pb2.FollowUp()
    )
    [dead] = joiner.feed(topics.EDIT, 2, 9, b"r1", wrong_topic.SerializeToString(), now_ms=0)
    assert dict(dead.headers)["error"] == b"payload followup does not belong on telemetry.edit.v1"
    assert (joiner.counters.dlq, joiner.counters.privacy_dropped, joiner.pending()) == (2, 1, 0)


def test_joiner_keeps_one_state_per_partition():
    joiner = Joiner(CONFIG)
    record = rollout_pb2.RolloutRecord(
        event_id="a1", rollout_id="r1", client_ts_ms=1000
    ).SerializeToString()
    far_ahead = telemetry_pb2.TelemetryEvent(
        event_id="b1", rollout_id="r2", client_ts_ms=9000, edit_shown=telemetry_pb2.EditShown()
    ).SerializeToString()
    assert joiner.feed(topics.ROLLOUT, 0, 0, b"r1", record, now_ms=0) == []
    # Stream time on partition 1 does not close windows on partition 0.
    assert joiner.feed(topics.EDIT, 1, 0, b"r2", far_ahead, now_ms=1) == []
    [settled] = joiner.tick(now_ms=1500)
    assert settled.topic == topics.REWARD and settled.key == b"r1"
    assert joiner.status().settled == 1 and joiner.status().defaulted == 1


def test_joiner_lag_hints_come_from_offsets_and_skipped_records():
    joiner = Joiner(CONFIG)
    # Partition 0 is taken over with two follow-ups still unread (offsets 5 and 6).
    positions = {
        topics.ROLLOUT: (3, 3),
        topics.EDIT: (0, 0),
        topics.PERSISTENCE: (0, 0),
        topics.FOLLOWUP: (5, 7),
    }
    joiner.restore(0, {}, now_ms=0, positions=positions)
    record = rollout_pb2.RolloutRecord(
        event_id="a1", rollout_id="r1", client_ts_ms=1000
    ).SerializeToString()
    assert (
        joiner.feed_record(
            topics.ROLLOUT, 0, 3, b"r1", record, now_ms=0, highwater=lambda: 4
        ).records
        == []
    )
    assert joiner.tick(now_ms=5000) == []  # past the deadline, but the follow-ups are still to come
    thanks = telemetry_pb2.TelemetryEvent(
        event_id="a2",
        rollout_id="r1",
        client_ts_ms=1100,
        followup=telemetry_pb2.FollowUp(message="thanks"),
    ).SerializeToString()
    assert (
        joiner.feed_record(
            topics.FOLLOWUP, 0, 5, b"r1", thanks, now_ms=5001, highwater=lambda: 7
        ).records
        == []
    )
    assert joiner.tick(now_ms=6000) == []
    # The last follow-up is a privacy-mode one the join never sees; reading it still
    # catches the source up, and r1 settles at once, with the follow-up before it.
    private = telemetry_pb2.TelemetryEvent(
        event_id="p1",
        rollout_id="r2",
        client_ts_ms=1200,
        privacy_mode=True,
        followup=telemetry_pb2.FollowUp(message="secret"),
    ).SerializeToString()
    batch = joiner.feed_record(
        topics.FOLLOWUP, 0, 6, b"r2", private, now_ms=6001, handle="h6", highwater=lambda: 7
    )
    [settled] = batch.records
    assert settled.topic == topics.REWARD and set(
        reward_pb2.RewardRecord.FromString(settled.value).event_ids
    ) == {"a1", "a2"}
    assert "h6" in batch.acks and joiner.counters.privacy_dropped == 1
