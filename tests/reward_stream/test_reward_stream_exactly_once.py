"""Kill -9 the joiner in the middle of 10,000 rollouts, restart it: exactly one reward
per rollout in the reward topic and in ClickHouse, nothing lost, nothing doubled, and
the consumer group ends committed at the end of every input partition (acks do
advance the offsets). The analytics sink consumes the reward topic meanwhile and is
itself killed -9 once mid-stream and restarted.

Guarantee 1 of docs/architecture.md, for the reward stream and its ClickHouse sink,
against a real Tansu and chdb.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter

import pytest
from confluent_kafka import Producer, TopicPartition

from rtrl import kafka, procs, topics
from rtrl.analytics.query import http_query_fn
from rtrl.v1 import reward_pb2, rollout_pb2
from rtrl_client.v1 import telemetry_pb2
from support import wait
from support.reward_stream import read_all
from support.signing import produce_as_its_writer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

N_ROLLOUTS = 10_000
SINK_GROUP = "analytics"

# The raw reward rows on disk, read by a separate process while the sink is down
# (chdb lets one process at a time open the directory).
RAW_REWARD_IDS = (
    """
import json
from rtrl.analytics import query
from rtrl.config import StackSettings
rows = query.client_query_fn(query.connect(StackSettings()))"""
    f"""("SELECT reward_id FROM rewards WHERE topic = '{topics.REWARD}'")
print(json.dumps([row["reward_id"] for row in rows]))
"""
)


def produce_rollouts(settings, base_ms: int) -> set[str]:
    """N rollouts of three records each (RolloutRecord, EditShown, PersistenceSnapshot),
    2 ms of event time apart, so stream time keeps settling earlier ones."""
    producer = Producer(kafka.producer_config(settings))
    ids = set()
    for i in range(N_ROLLOUTS):
        rollout_id = f"r{i:05d}"
        ts = base_ms + 2 * i
        record = rollout_pb2.RolloutRecord(
            event_id=str(uuid.uuid4()),
            rollout_id=rollout_id,
            client_ts_ms=ts,
            completion_text="x = 1\n",
            completion_token_ids=[7] * 4,
        )
        shown = telemetry_pb2.TelemetryEvent(
            event_id=str(uuid.uuid4()),
            rollout_id=rollout_id,
            client_ts_ms=ts + 1,
            edit_shown=telemetry_pb2.EditShown(edit_text="x = 1\n"),
        )
        kept = telemetry_pb2.TelemetryEvent(
            event_id=str(uuid.uuid4()),
            rollout_id=rollout_id,
            client_ts_ms=ts + 2,
            persistence=telemetry_pb2.PersistenceSnapshot(region_text="x = 1\n"),
        )
        produce_as_its_writer(producer, topics.ROLLOUT, record.SerializeToString(), rollout_id)
        for topic, event in ((topics.EDIT, shown), (topics.PERSISTENCE, kept)):
            value = event.SerializeToString()
            produce_as_its_writer(producer, topic, value, rollout_id)
        producer.poll(0)
        ids.add(rollout_id)
    assert producer.flush(30) == 0
    return ids


def rewards_written(settings) -> int:
    ends = kafka.end_offsets(
        settings, [TopicPartition(topics.REWARD, p) for p in range(settings.kafka_partitions)]
    )
    return sum(ends.values())


def sink_lag(settings) -> list[kafka.PartitionLag]:
    return kafka.consumer_lag(settings, SINK_GROUP, (topics.REWARD,))


def raw_reward_ids_on_disk(env: dict[str, str]) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", RAW_REWARD_IDS],
        env={**os.environ, **env},
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def kill_9(service: procs.Proc) -> None:
    os.killpg(service.pid, signal.SIGKILL)
    service.popen.wait()


@pytest.mark.guarantee(1)
def test_kill_9_mid_stream_loses_and_doubles_nothing(
    stack_settings, stack_env, tmp_path, repo_root
):
    joiner_env = {**stack_env, "RTRL_REWARD_WINDOW_S": "1", "RTRL_REWARD_GRACE_S": "0.2"}
    sink_env = {
        **stack_env,
        "PYTHONPATH": str(repo_root),
        "RTRL_ANALYTICS_BATCH_SIZE": "2000",
        "RTRL_ANALYTICS_FLUSH_INTERVAL_S": "0.5",
    }
    token = sink_env["RTRL_ANALYTICS_QUERY_TOKEN"] = secrets.token_urlsafe(16)
    joiner_log, sink_log = tmp_path / "reward_stream.log", tmp_path / "analytics.log"

    def start_joiner() -> procs.Proc:
        joiner_env["RTRL_REWARD_WEB_PORT"] = str(procs.free_port())
        return procs.spawn(
            "reward_stream",
            [sys.executable, "-m", "rtrl.reward_stream"],
            joiner_log,
            env=joiner_env,
        )

    def start_sink() -> procs.Proc:
        port = procs.free_port()
        sink_env["RTRL_ANALYTICS_QUERY_PORT"] = str(port)
        return procs.spawn(
            "analytics", [sys.executable, "-m", "rtrl.analytics"], sink_log, env=sink_env, port=port
        )

    def both() -> list[wait.Watched]:
        return [wait.Watched(joiner, joiner_log), wait.Watched(sink, sink_log)]

    ids = produce_rollouts(stack_settings, int(time.time() * 1000))
    joiner, sink = start_joiner(), start_sink()
    try:
        wait.until(
            lambda: rewards_written(stack_settings),
            "a quarter of the rewards written before the joiner's kill",
            ready=lambda written: written >= N_ROLLOUTS // 4,
            timeout_s=120,
            interval_s=0.1,
            watching=both(),
        )
        kill_9(joiner)
        killed_at = rewards_written(stack_settings)
        assert killed_at < N_ROLLOUTS, (
            "the kill came after everything had settled; it proves nothing"
        )

        # The sink, with the joiner down: mid-stream (the topic stops short of N), and
        # killed at a point of its consume/insert/commit cycle that differs from run to run.
        wait.until(
            lambda: sum(max(p.committed, 0) for p in sink_lag(stack_settings)),
            "an eighth of the rewards committed by the sink before its kill",
            ready=lambda committed: committed >= N_ROLLOUTS // 8,
            timeout_s=60,
            interval_s=0.1,
            watching=[wait.Watched(sink, sink_log)],
        )
        time.sleep(random.uniform(0, 0.5))
        kill_9(sink)
        # Read the disk first: by then a commit the sink had sent just before dying has landed.
        on_disk_at_kill = Counter(raw_reward_ids_on_disk(sink_env))
        committed_at_kill = sum(max(p.committed, 0) for p in sink_lag(stack_settings))

        joiner, sink = start_joiner(), start_sink()
        wait.until(
            lambda: rewards_written(stack_settings),
            "every rollout settled after the restart",
            ready=lambda written: written >= N_ROLLOUTS,
            timeout_s=180,
            interval_s=0.1,
            watching=both(),
        )
        # Nothing doubled is still on its way once every input is committed: the joiner
        # commits an input only once the outputs it produced are acknowledged.
        lag = wait.until(
            lambda: kafka.consumer_lag(stack_settings, "rtrl-reward-stream", topics.TELEMETRY),
            "the joiner to commit every input partition to its end",
            ready=lambda lag: all(p.lag <= 0 for p in lag),
            timeout_s=60,
            interval_s=0.2,
            watching=both(),
        )
        wait.until(
            lambda: sink_lag(stack_settings),
            "the sink to catch up with the reward topic",
            ready=lambda lag: all(p.lag <= 0 for p in lag),
            timeout_s=60,
            interval_s=0.1,
            watching=both(),
        )
        query = http_query_fn(f"http://127.0.0.1:{sink.port}", token)
        final = query(
            f"SELECT rollout_id, reward_id FROM rewards FINAL WHERE topic = '{topics.REWARD}'"
        )
        raw = query(
            f"SELECT reward_id, count() AS n FROM rewards WHERE topic = '{topics.REWARD}' GROUP BY reward_id"
        )
    finally:
        joiner.stop(timeout_s=20)
        sink.stop(timeout_s=30)
    assert sink.popen.returncode == 0, sink_log.read_text()[-3000:]

    rewards = [
        reward_pb2.RewardRecord.FromString(m.value())
        for m in read_all(stack_settings, (topics.REWARD,))[topics.REWARD]
    ]
    per_rollout = Counter(r.rollout_id for r in rewards)
    assert set(per_rollout) == ids
    assert max(per_rollout.values()) == 1, [rid for rid, n in per_rollout.items() if n > 1][:5]
    assert len({r.reward_id for r in rewards}) == N_ROLLOUTS
    assert all(len(r.event_ids) == 3 and not r.defaulted for r in rewards)
    assert killed_at >= N_ROLLOUTS // 4
    # Every input partition committed to its end. (Tansu can report a committed offset
    # past what end_offsets finds, a quirk of its batch offsets; never one short of it.)
    assert [(p.topic, p.partition, p.committed, p.end) for p in lag if p.lag > 0] == []

    # ClickHouse, deduplicated: one row per rollout, with the topic's reward_id.
    assert Counter(row["rollout_id"] for row in final) == Counter(ids)
    assert {(row["rollout_id"], row["reward_id"]) for row in final} == {
        (r.rollout_id, r.reward_id) for r in rewards
    }

    # ClickHouse, raw. The sink commits offsets only after inserting the rows they
    # cover, so a kill between an insert and its commit makes the restarted sink insert
    # those rows again, and the ReplacingMergeTree collapses them only when a background
    # merge gets to them (hence FINAL above). That is all the sink may double: rows on
    # disk at the kill past its committed offsets (offsets are dense: the joiner writes
    # no transaction markers), each once more, and merges only ever remove doubles. The
    # window is one commit round trip, so most runs expect none; a double anywhere else
    # fails here.
    on_disk = sum(on_disk_at_kill.values())
    assert max(on_disk_at_kill.values()) == 1 and committed_at_kill <= on_disk < N_ROLLOUTS
    raw_counts = {row["reward_id"]: row["n"] for row in raw}
    doubled = {reward_id for reward_id, n in raw_counts.items() if n > 1}
    assert set(raw_counts) == {r.reward_id for r in rewards}
    assert doubled <= set(on_disk_at_kill) and all(
        raw_counts[reward_id] == 2 for reward_id in doubled
    ), doubled
    assert sum(raw_counts.values()) <= N_ROLLOUTS + on_disk - committed_at_kill
