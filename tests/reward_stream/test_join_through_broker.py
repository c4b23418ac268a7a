"""Join traces through the real broker and worker must give what the pure join gives.

Each trace is a list of records produced in order (some out of event-time order,
some duplicated, one from a privacy-mode user, one follow-up that never comes). The
same records are fed to the pure runtime (runtime.Joiner, in process) and produced
to a real Tansu for `python -m rtrl.reward_stream`; the reward records of both paths must
agree on everything but the wall-clock settle time.
"""

from __future__ import annotations

import sys
import time
import uuid

import pytest
import redis
from confluent_kafka import Producer
from rich.progress import Progress

from rtrl import kafka, procs, topics
from rtrl.bench.join import produce_load
from rtrl.heartbeat import RewardStreamBeat
from rtrl.reward_stream.config import RewardStreamSettings
from rtrl.reward_stream.runtime import Joiner
from rtrl.v1 import reward_pb2, rollout_pb2
from rtrl_client.v1 import telemetry_pb2
from support.beats import wait_for_beat
from support.reward_stream import read_all, spawn_joiner
from support.signing import produce_as_its_writer

pytestmark = pytest.mark.integration


def traces(base_ms: int) -> list[tuple[str, str, bytes]]:
    """(topic, rollout_id, value) in production order."""
    records: list[tuple[str, str, bytes]] = []

    def rollout(rid: str, ts: int) -> None:
        message = rollout_pb2.RolloutRecord(
            event_id=f"{rid}-r", rollout_id=rid, client_ts_ms=ts, completion_text="x = 1\n"
        )
        records.append((topics.ROLLOUT, rid, message.SerializeToString()))

    def event(rid: str, suffix: str, ts: int, private: bool = False, **payload) -> None:
        message = telemetry_pb2.TelemetryEvent(
            event_id=f"{rid}-{suffix}",
            rollout_id=rid,
            client_ts_ms=ts,
            privacy_mode=private,
            **payload,
        )
        records.append(
            (topics.BY_PAYLOAD[message.WhichOneof("payload")], rid, message.SerializeToString())
        )

    snapshot = telemetry_pb2.PersistenceSnapshot(region_text="x = 1\n")
    # out of order: the snapshot (ts +50) is produced after the follow-up (ts +300), within grace
    rollout("ooo", base_ms)
    event("ooo", "f", base_ms + 300, followup=telemetry_pb2.FollowUp(message="thanks"))
    event("ooo", "p", base_ms + 50, persistence=snapshot)
    # duplicated: the same follow-up twice, and the RolloutRecord again
    rollout("dup", base_ms + 10)
    event(
        "dup",
        "f",
        base_ms + 20,
        followup=telemetry_pb2.FollowUp(message="no, that broke the build"),
    )
    event(
        "dup",
        "f",
        base_ms + 20,
        followup=telemetry_pb2.FollowUp(message="no, that broke the build"),
    )
    rollout("dup", base_ms + 10)
    # privacy mode: the user's follow-up must not be joined
    rollout("priv", base_ms + 30)
    event(
        "priv",
        "f",
        base_ms + 40,
        private=True,
        followup=telemetry_pb2.FollowUp(message="my secret code"),
    )
    # missing follow-up: only the RolloutRecord and an edit shown
    rollout("quiet", base_ms + 60)
    event("quiet", "s", base_ms + 70, edit_shown=telemetry_pb2.EditShown(edit_text="x = 1\n"))
    # the rollout record arrives after its telemetry
    event("late-record", "p", base_ms + 80, persistence=snapshot)
    rollout("late-record", base_ms + 80)
    return records


def comparable(record: reward_pb2.RewardRecord) -> reward_pb2.RewardRecord:
    out = reward_pb2.RewardRecord()
    out.CopyFrom(record)
    out.ClearField("settled_ts_ms")
    out.ClearField("traceparent")  # each settle is a span of its own
    return out


def test_broker_path_matches_the_pure_join(stack_settings, stack_env, redis_url, tmp_path):
    base_ms = int(time.time() * 1000)
    records = traces(base_ms)
    settings = RewardStreamSettings(window_s=1, grace_s=0.5)

    pure = Joiner(settings.join_config())
    for offset, (topic, rid, value) in enumerate(records):
        pure.feed(topic, 0, offset, rid.encode(), value, now_ms=base_ms)
    expected = {}
    for out in pure.tick(now_ms=base_ms + 60_000):
        record = reward_pb2.RewardRecord.FromString(out.value)
        expected[record.rollout_id] = comparable(record)
    assert set(expected) == {"ooo", "dup", "priv", "quiet", "late-record"}
    assert "priv-f" not in expected["priv"].event_ids and "ooo-p" in expected["ooo"].event_ids

    service = spawn_joiner(stack_env, tmp_path, grace_s="0.5")
    try:
        producer = Producer(kafka.producer_config(stack_settings))
        for topic, rid, value in records:
            produce_as_its_writer(producer, topic, value, rid)
            producer.flush(
                10
            )  # one at a time, so the broker keeps the production order per partition
        hb = redis.Redis.from_url(redis_url)
        # Nothing more may come: every record read, no rollout pending, every reward acked.
        status = wait_for_beat(
            hb,
            RewardStreamBeat,
            "every record read, every rollout settled and every reward acked",
            ready=lambda beat: (
                beat.events >= len(records)
                and beat.settled >= len(expected)
                and beat.pending == 0
                and beat.in_flight == 0
            ),
        )
        assert (status.duplicates, status.privacy_dropped) == (2, 1)
        got = {}
        for message in read_all(stack_settings, (topics.REWARD,))[topics.REWARD]:
            record = reward_pb2.RewardRecord.FromString(message.value())
            assert record.rollout_id not in got, f"two rewards for {record.rollout_id}"
            got[record.rollout_id] = comparable(record)
    finally:
        service.stop(timeout_s=20)
    assert got == expected
    assert uuid.UUID(got["ooo"].reward_id)  # a deterministic UUID, same on both paths


BACKLOG_ROLLOUTS = 4_000


def test_a_backlog_read_unevenly_still_joins_every_event(
    stack_settings, stack_env, redis_url, tmp_path
):
    """A worker started on a backlog reads its four topics unevenly: on the bench's load
    (RolloutRecords of ~1.4 KB, telemetry of ~0.5 KB, 2 ms of event time apart) whole
    seconds of one topic's event time are read before another's. Every rollout must still
    settle once, with all three of its records, none defaulted, late or dropped. Without
    the lag hints, most of them settled with defaults and their telemetry went to .late."""
    base_ms = int(time.time() * 1000) - 2 * BACKLOG_ROLLOUTS - 60_000
    with Progress(transient=True) as progress:
        ids, _ = produce_load(stack_settings, BACKLOG_ROLLOUTS, 2, base_ms, 2500, progress)

    env = {**stack_env, "RTRL_REWARD_WEB_PORT": str(procs.free_port())}
    service = procs.spawn(
        "reward_stream",
        [sys.executable, "-m", "rtrl.reward_stream"],
        tmp_path / "reward_stream.log",
        env=env,
    )
    try:
        hb = redis.Redis.from_url(redis_url)
        # In flight: the rewards counted settled but not yet acked by the broker.
        status = wait_for_beat(
            hb,
            RewardStreamBeat,
            "every record read and every reward acked",
            ready=lambda beat: (
                beat.events >= 3 * len(ids) and beat.pending == 0 and beat.in_flight == 0
            ),
            timeout_s=120,
        )
        rewards = [
            reward_pb2.RewardRecord.FromString(m.value())
            for m in read_all(stack_settings, (topics.REWARD,))[topics.REWARD]
        ]
    finally:
        service.stop(timeout_s=20)
    assert {k: getattr(status, k) for k in ("settled", "defaulted", "late", "dropped")} == {
        "settled": len(ids),
        "defaulted": 0,
        "late": 0,
        "dropped": 0,
    }
    assert sorted(r.rollout_id for r in rewards) == sorted(ids)
    assert all(len(r.event_ids) == 3 for r in rewards)
