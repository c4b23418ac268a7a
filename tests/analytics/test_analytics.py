"""The analytics sink and the A/B report: replays collapse, the numbers are the hand-computed ones."""

import asyncio
import json
import os
import secrets
import signal
import sys

import pytest
import redis

from rtrl import kafka, procs, signing, topics
from rtrl.analytics import report, schema
from rtrl.analytics.authn import DEAD_LETTER
from rtrl.analytics.query import client_query_fn, connect, http_query_fn
from rtrl.analytics.rows import KafkaRecord
from rtrl.config import StackSettings
from rtrl.heartbeat import AnalyticsBeat
from rtrl_client.client import make_event
from rtrl_client.v1 import telemetry_pb2
from support import signed, wait
from support.analytics import T0, RecordingConsumer, hand_made_records
from support.beats import wait_for_beat

pytestmark = pytest.mark.integration


def by_metric(rows, window):
    return {r.metric: r for r in rows if r.window == window}


def test_ab_numbers_match_the_hand_computed_ones(tmp_path):
    client = connect(StackSettings(state_dir=tmp_path))
    try:
        schema.create_tables(client)
        consumer = RecordingConsumer()
        # The recording double stands in for the sink's confluent_kafka Consumer.
        sink = signed.checking_sink(client, consumer)
        rollouts, rewards = hand_made_records()
        offsets: dict[str, int] = {}

        def feed(topic, message, headers=()):
            offset = offsets[topic] = offsets.get(topic, -1) + 1
            sink.add(
                signed.record(
                    topic,
                    0,
                    offset,
                    message.rollout_id.encode(),
                    message.SerializeToString(),
                    headers,
                )
            )

        for r in rollouts:
            feed(topics.ROLLOUT, r)
        for r in rewards:
            feed(topics.REWARD, r)
        sink.flush()
        # a replay of already inserted records in a later insert, and a late re-emission
        feed(topics.ROLLOUT, rollouts[4])
        feed(topics.REWARD, rewards[0])
        # inputs the joiner set aside as late, with the headers it gives them
        late_event = telemetry_pb2.TelemetryEvent(
            event_id="late-1",
            rollout_id=rollouts[1].rollout_id,
            client_ts_ms=T0 + 5_000,
            followup=telemetry_pb2.FollowUp(message="no"),
        )
        feed(
            topics.REWARD_LATE,
            late_event,
            (("source_topic", topics.FOLLOWUP.encode()), ("kind", b"followup")),
        )
        feed(
            topics.REWARD_LATE,
            late_event,
            (("source_topic", topics.FOLLOWUP.encode()), ("kind", b"followup")),
        )  # written again after a crash
        feed(
            topics.REWARD_LATE,
            rollouts[2],
            (("source_topic", topics.ROLLOUT.encode()), ("kind", b"rollout")),
        )
        sink.add(signed.record(topics.EDIT, 3, 0, b"r9", b"\xff\xfe not protobuf"))
        sink.add(
            KafkaRecord(topics.REWARD_DLQ, 1, 5, b"r8", b"raw", (("reason", b"no rollout record"),))
        )
        sink.flush()
        assert consumer.commits[-1] == {
            (topics.ROLLOUT, 0): 10,
            (topics.REWARD, 0): 10,
            (topics.REWARD_LATE, 0): 3,
            (topics.EDIT, 3): 1,
            (topics.REWARD_DLQ, 1): 6,
        }

        query = client_query_fn(client)
        assert query("SELECT count() AS n FROM rollouts FINAL") == [{"n": 9}]
        assert query(
            "SELECT count(DISTINCT reward_id) AS n FROM rewards WHERE topic = 'rl.reward.v1'"
        ) == [{"n": 9}]
        assert query("SELECT count() AS n FROM rewards") == [{"n": 10}], (
            "a late input is not a reward"
        )
        assert query(
            "SELECT source_topic, kind, rollout_id FROM late_records FINAL ORDER BY kind"
        ) == [
            {
                "source_topic": topics.FOLLOWUP,
                "kind": "followup",
                "rollout_id": rollouts[1].rollout_id,
            },
            {
                "source_topic": topics.ROLLOUT,
                "kind": "rollout",
                "rollout_id": rollouts[2].rollout_id,
            },
        ]
        letters = query("SELECT topic, reason, headers_json FROM dead_letters FINAL ORDER BY topic")
        assert [(d["topic"], json.loads(d["headers_json"]).keys()) for d in letters] == [
            (topics.REWARD_DLQ, {"reason"}),
            (topics.EDIT, {signing.MAC_HEADER}),  # the gateway's MACs, kept as they came
        ]
        assert json.loads(letters[0]["headers_json"]) == {"reason": "no rollout record"}
        assert letters[0]["reason"] == DEAD_LETTER.reason, "a dead letter's own reason is a claim"
        assert "does not decode" in letters[1]["reason"]
        assert query(
            "SELECT policy_version_min AS lo, policy_version_max AS hi FROM rollouts FINAL WHERE rollout_id = 't4'"
        ) == [{"lo": 2, "hi": 3}]

        rows = report.ab_table(query)
        every = by_metric(rows, "all")
        # control: persisted c1, c4 of 4; dissatisfied c2 of 4; mean (1 - .5 + 0 + .8) / 4; median(.1 .2 .3 .4)
        # treatment: persisted t2, t3, t4 of 5; dissatisfied t1, t5 of 5; mean 2 / 5; median(.1 .1 .2 .3 .5)
        expected = {
            "rollouts": (4, 5, None),
            "rewards": (4, 5, None),
            "persisted_rate": (0.5, 0.6, 0.2),
            "dissatisfied_rate": (0.25, 0.4, 0.6),
            "reward_mean": (0.325, 0.4, 0.075 / 0.325),
            "latency_p50_s": (0.25, 0.2, -0.2),
        }
        for metric, (control, treatment, change) in expected.items():
            row = every[metric]
            assert (row.control, row.treatment) == pytest.approx((control, treatment)), metric
            assert row.relative_change == (None if change is None else pytest.approx(change)), (
                metric
            )

        # the run spans T0 .. T0+1000 s; the last half starts at +500 s: c3 c4 | t3 t4 t5
        late = by_metric(rows, "last_half")
        expected = {
            "rollouts": (2, 3, None),
            "persisted_rate": (0.5, 2 / 3, 1 / 3),
            "dissatisfied_rate": (0.0, 1 / 3, None),  # no change relative to a zero control
            "reward_mean": (0.4, 2 / 3, 2 / 3),
            "latency_p50_s": (0.35, 0.3, -1 / 7),
        }
        for metric, (control, treatment, change) in expected.items():
            row = late[metric]
            assert (row.control, row.treatment) == pytest.approx((control, treatment)), metric
            assert row.relative_change == (None if change is None else pytest.approx(change)), (
                metric
            )

        tables = report.ab_json(rows)  # reports/ab.json
        assert tables["whole_run"]["control"] == pytest.approx(
            {
                "edits_persisted": 0.5,
                "dissatisfied_followups": 0.25,
                "latency_p50_ms": 250.0,
                "rollouts": 4,
            }
        )
        assert tables["second_half"]["treatment"] == pytest.approx(
            {
                "edits_persisted": 2 / 3,
                "dissatisfied_followups": 1 / 3,
                "latency_p50_ms": 300.0,
                "rollouts": 3,
            }
        )

        versions = [
            (v.arm, v.policy_version, v.rewards, v.persisted_rate, v.dissatisfied_rate)
            for v in report.by_version(query, bucket_size=1)
        ]
        assert versions == [
            ("control", 0, 4, 0.5, 0.25),
            ("treatment", 1, 2, 0.5, 0.5),
            ("treatment", 2, 1, 1.0, 0.0),
            ("treatment", 3, 2, 0.5, 0.5),
        ]
        buckets = report.by_version(query, bucket_size=2)
        assert [(v.arm, v.policy_version, v.rewards) for v in buckets] == [
            ("control", 0, 4),
            ("treatment", 0, 2),
            ("treatment", 2, 3),
        ]

        page = report.write_html(
            tmp_path / "report" / "ab.html", rows, report.by_version(query)
        ).read_text()
        assert "data:image/png;base64,iVBOR" in page  # an embedded PNG
        assert "+20.00 %" in page and "persisted_rate" in page
    finally:
        client.close()


def test_sink_deduplicates_replays_and_commits_after_insert(
    stack_settings, stack_env, tmp_path, repo_root
):
    port = procs.free_port()
    token = secrets.token_urlsafe(16)
    env = {
        **stack_env,
        "RTRL_ANALYTICS_QUERY_PORT": str(port),
        "RTRL_ANALYTICS_BATCH_SIZE": "4",
        "RTRL_ANALYTICS_FLUSH_INTERVAL_S": "0.2",
        "RTRL_ANALYTICS_QUERY_TOKEN": token,
        "PYTHONPATH": str(repo_root),
    }
    sink = procs.spawn(
        "analytics",
        [sys.executable, "-m", "rtrl.analytics"],
        tmp_path / "analytics.log",
        env=env,
        port=port,
    )
    rollouts, rewards = hand_made_records()
    events = [
        make_event(r.rollout_id, "s1", "u1", followup=telemetry_pb2.FollowUp(message="no"))
        for r in rollouts[:3]
    ]

    async def produce():
        producer = kafka.AsyncProducer(stack_settings)
        try:
            records = [(topics.ROLLOUT, r) for r in rollouts + rollouts[:4]]
            records += [(topics.REWARD, r) for r in rewards + rewards[2:5]]
            records += [(topics.FOLLOWUP, e) for e in events + events[:1]]
            sends = []
            for topic, message in records:
                value = message.SerializeToString()
                headers = list(signed.headers(topic, value))
                sends.append(producer.send(topic, value, key=message.rollout_id, headers=headers))
            await asyncio.gather(*sends)
        finally:
            producer.close()

    try:
        asyncio.run(produce())
        procs.wait_for_port(port, timeout_s=30)
        query = http_query_fn(f"http://127.0.0.1:{port}", token)
        counts = (
            "SELECT (SELECT count() FROM rollouts FINAL) AS rollouts, "
            "(SELECT count(DISTINCT reward_id) FROM rewards) AS rewards, "
            "(SELECT count() FROM telemetry_events FINAL) AS events"
        )
        wait.until(
            lambda: query(counts),
            "the sink to catch up",
            ready=lambda rows: rows == [{"rollouts": 9, "rewards": 9, "events": 3}],
            timeout_s=60,
            interval_s=0.3,
            watching=[wait.Watched(sink, tmp_path / "analytics.log")],
        )
        rows = by_metric(report.ab_table(query), "all")
        assert (rows["rollouts"].control, rows["rollouts"].treatment) == (4, 5)
        assert rows["persisted_rate"].relative_change == pytest.approx(0.2)

        assert query("select 1 AS x;") == [{"x": 1}]
        assert query("SELECT 2 AS y -- a trailing comment") == [{"y": 2}]
        outfile = tmp_path / "out.csv"
        refused = (
            "DROP TABLE rollouts",
            "INSERT INTO rollouts (rollout_id) VALUES ('x')",
            "SELECT 1; DROP TABLE rollouts",
            "WITH 1 AS x SELECT x FROM system.one; DROP TABLE rewards",
            f"SELECT 1 INTO OUTFILE '{outfile}'",
            "SELECT * FROM file('/etc/hostname', 'LineAsString')",
            "SELECT 1 FORMAT JSON",
        )
        for statement in refused:
            with pytest.raises(RuntimeError, match="HTTP 400"):
                query(statement)
        assert not outfile.exists()

        # Every record is inserted, replays included (the tables collapse them). The sink
        # flushes in batches, so wait for all three counters rather than read them once.
        expected = {"rollouts": 13, "rewards": 12, "telemetry_events": 4}
        wait_for_beat(
            redis.Redis.from_url(stack_settings.redis_url),
            AnalyticsBeat,
            f"{expected} inserted",
            ready=lambda beat: {k: beat.inserted.get(k) for k in expected} == expected,
            timeout_s=20,
        )
    finally:
        os.killpg(sink.pid, signal.SIGTERM)
        assert sink.popen.wait(timeout=30) == 0, (tmp_path / "analytics.log").read_text()

    lag = kafka.consumer_lag(
        stack_settings, "analytics", (topics.ROLLOUT, topics.REWARD, topics.FOLLOWUP)
    )
    assert sum(p.lag for p in lag) == 0
    assert {p.topic for p in lag if p.committed > 0} == {
        topics.ROLLOUT,
        topics.REWARD,
        topics.FOLLOWUP,
    }

    # with the sink down the tables open directly, same answers
    client = connect(stack_settings)
    try:
        assert client_query_fn(client)(counts) == [{"rollouts": 9, "rewards": 9, "events": 3}]
    finally:
        client.close()
