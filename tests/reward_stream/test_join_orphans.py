"""M3: events about rollouts no worker served cannot fill the joiner.

On e9251e0 such events waited for the longest trajectory's wait (66 minutes): 1,100
events of 68 KB were +122 MB in a minute. Now the gateway says which events are about a
rollout no worker served (kafka.UNSERVED_HEADER: the serving API marks every rollout it
serves before answering), and the joiner drops those when their window closes (a few
seconds), counted. Events it cannot tell about (an auth-less gateway, a header stripped
on the broker) wait as before, but a client's rollouts without a RolloutRecord hold at most its share of bytes, and all
clients' together at most the total, the oldest evicted first and counted.
"""

from __future__ import annotations

import pytest

from rtrl import kafka, topics
from rtrl.reward_stream.codec import message_of
from rtrl.reward_stream.config import RewardStreamSettings
from rtrl.reward_stream.runtime import Joiner
from rtrl.v1 import common_pb2, rollout_pb2
from rtrl_client.v1 import telemetry_pb2

T0 = 1_800_000_000_000
EDIT_TEXT = "x" * (64 * 1024)
PATH = "p" * (4 * 1024 - 1)
"""An edit at the gateway's bounds: 68 KB on the wire, the attack's size."""
UNSERVED = [(kafka.UNSERVED_HEADER, b"1")]
SHARE = RewardStreamSettings().orphan_bytes_per_client
TOTAL = RewardStreamSettings().orphan_bytes


def _shown(rollout_id: str, client_id: str, n: int = 0) -> bytes:
    return telemetry_pb2.TelemetryEvent(
        event_id=f"{rollout_id}-shown-{n}", rollout_id=rollout_id, client_ts_ms=T0 + n,
        schema_version=1, user_id="u", session_id="s", client_id=client_id,
        edit_shown=telemetry_pb2.EditShown(file_path=PATH, edit_text=EDIT_TEXT),
    ).SerializeToString()  # fmt: skip


def _rollout(rollout_id: str, client_id: str) -> bytes:
    return rollout_pb2.RolloutRecord(
        event_id=f"{rollout_id}-r", rollout_id=rollout_id, client_ts_ms=T0, client_id=client_id,
        arm=common_pb2.ARM_TREATMENT, completion_token_ids=[5, 6], completion_logprobs=[-0.1, -0.2],
    ).SerializeToString()  # fmt: skip


def _joiner() -> Joiner:
    return Joiner(RewardStreamSettings().join_config())


def _held_bytes(joiner: Joiner, client: str | None = None) -> int:
    """Bytes of telemetry the joiner holds for rollouts not settled yet (of ``client``'s
    events alone, if given)."""
    state = joiner.states[0]
    waiting = [*state.pending.values(), *state.incomplete.values()]
    return sum(
        message_of(event).ByteSize()
        for p in waiting
        for event in p.events
        if client is None or message_of(event).client_id == client
    )


def _feed(
    joiner: Joiner, offset: int, rollout_id: str, value: bytes, headers=(), topic=topics.EDIT
) -> None:
    joiner.feed_record(
        topic, 0, offset, rollout_id.encode(), value, T0 + 1_000, headers=list(headers)
    )


@pytest.mark.guarantee(7)
def test_m3_events_about_a_rollout_no_worker_served_are_dropped_when_its_window_closes():
    """M3: 1,100 events of 68 KB about rollouts the gateway knows were never served wait
    only their window (3.5 s by default), within the client's share, not the longest
    trajectory's 66 minutes; then nothing waits and each rollout is counted. A served
    rollout whose record is read after its stamped event still settles with it."""
    joiner = _joiner()
    config = joiner.config
    for n in range(1_100):
        joiner.feed_record(
            topics.EDIT, 0, n, f"ghost-{n}".encode(), _shown(f"ghost-{n}", "mallory"),
            T0 + 1_000, headers=UNSERVED,
        )  # fmt: skip
    assert _held_bytes(joiner, "mallory") <= SHARE
    _feed(joiner, 1_100, "late-record", _shown("late-record", "alice"), UNSERVED)
    _feed(joiner, 1_101, "late-record", _rollout("late-record", "alice"), topic=topics.ROLLOUT)
    closed = T0 + 1_000 + config.window_ms + config.deadline_slack_ms
    rewards = [r for r in joiner.tick_batch(closed).records if r.topic == topics.REWARD]
    assert [r.key for r in rewards] == [b"late-record"]
    assert joiner.pending() == 0 and _held_bytes(joiner) == 0
    assert joiner.counters.orphans_dropped + joiner.counters.evicted == 1_100
    assert joiner.counters.dropped == 0


# (clients flooding, events of 68 KB each sends): one client past its share, then ten
# clients each within its share but together past the total.
CASES = {"one_client": (1, 1_100), "many_clients": (10, (SHARE // 70_000) - 1)}


@pytest.mark.guarantee(7)
@pytest.mark.parametrize("clients, each", CASES.values(), ids=CASES.keys())
def test_m3_rollouts_without_a_record_hold_at_most_each_clients_share_and_the_total(clients, each):
    """M3: orphan events the joiner cannot tell about (no gateway stamp) are bounded per
    client and in total; the oldest are evicted and counted, and an honest client's
    rollout waiting for its record (an agent's, sent before the flood) settles whole."""
    joiner = _joiner()
    _feed(joiner, 0, "honest", _shown("honest", "alice"))
    offset = 1
    for n in range(each):
        for c in range(clients):
            rollout_id = f"ghost-{c}-{n}"
            _feed(joiner, offset, rollout_id, _shown(rollout_id, f"mallory-{c}"))
            offset += 1
    floods = [_held_bytes(joiner, f"mallory-{c}") for c in range(clients)]
    assert max(floods) <= SHARE and _held_bytes(joiner) <= TOTAL
    state = joiner.states[0]
    waiting = [r for r in (*state.pending, *state.incomplete) if r.startswith("ghost-")]
    assert joiner.counters.evicted == clients * each - len(waiting) > 0  # each one counted
    assert "honest" in state.pending or "honest" in state.incomplete
    settled = joiner.feed_record(
        topics.ROLLOUT, 0, offset, b"honest", _rollout("honest", "alice"), T0 + 4_000
    )
    rewards = [r for r in settled.records if r.topic == topics.REWARD]
    assert len(rewards) == 1
    assert "alice" not in joiner.states[0].orphans.client_bytes  # its record released its share
