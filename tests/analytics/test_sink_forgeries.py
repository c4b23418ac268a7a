"""Guarantee 7 for the A/B report: whatever is written to the broker around the signed path
(the embedded broker has no ACLs) stays out of the sink's tables, and so out of the A/B, the
status view and the training report. Each attack writes straight to a real Tansu broker,
read by a real `python -m rtrl.analytics` into chdb, next to records signed as their
writers sign them (support/signed.py), which do land."""

from __future__ import annotations

import os
import secrets
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from confluent_kafka import Producer

from rtrl import kafka, procs, signing, topics
from rtrl.analytics import report, training_report
from rtrl.analytics.query import QueryFn, http_query_fn
from rtrl.v1 import trainer_pb2
from rtrl_client.client import make_event
from rtrl_client.v1 import telemetry_pb2
from support import signed, wait
from support.analytics import hand_made_records, reward, rollout

pytestmark = [pytest.mark.integration, pytest.mark.guarantee(7)]

# Every row the sink stores, in whichever table: each record produced here becomes one.
STORED = " + ".join(
    f"(SELECT count() FROM {table} FINAL)"
    for table in (
        "rollouts",
        "rewards",
        "telemetry_events",
        "trainer_steps",
        "late_records",
        "dead_letters",
    )
)


@dataclass
class RunningSink:
    query: QueryFn
    producer: Producer
    proc: procs.Proc
    log: Path
    produced: int = 0

    def send(self, topic: str, value: bytes, key: str, headers=()) -> None:
        """Straight to the broker, with exactly ``headers``."""
        self.producer.produce(topic, value, key=key, headers=kafka.kafka_headers(headers))
        self.produced += 1

    def send_signed(self, topic: str, value: bytes, key: str) -> None:
        """As ``topic``'s writer sends it."""
        signed.produce(self.producer, topic, value, key)
        self.produced += 1

    def settle(self) -> None:
        """Until every record sent is a row somewhere (a table or dead_letters)."""
        assert self.producer.flush(30) == 0, "records not acknowledged by the broker"
        wait.until(
            lambda: self.query(f"SELECT {STORED} AS n")[0]["n"],
            f"{self.produced} records stored",
            ready=lambda n: n == self.produced,
            timeout_s=60,
            interval_s=0.3,
            watching=[wait.Watched(self.proc, self.log)],
        )

    def dead_letters(self, topic: str) -> dict[str, str]:
        """Key -> reason of each dead letter from ``topic``."""
        rows = self.query(f"SELECT key, reason FROM dead_letters FINAL WHERE topic = '{topic}'")
        return {row["key"]: row["reason"] for row in rows}


@pytest.fixture
def sink(stack_settings, stack_env, tmp_path, repo_root) -> Iterator[RunningSink]:
    port = procs.free_port()
    token = secrets.token_urlsafe(16)
    log = tmp_path / "analytics.log"
    env = {
        **stack_env,
        "RTRL_ANALYTICS_QUERY_PORT": str(port),
        "RTRL_ANALYTICS_FLUSH_INTERVAL_S": "0.2",
        "RTRL_ANALYTICS_QUERY_TOKEN": token,
        "PYTHONPATH": str(repo_root),
    }
    proc = procs.spawn(
        "analytics", [sys.executable, "-m", "rtrl.analytics"], log, env=env, port=port
    )
    producer = Producer(kafka.producer_config(stack_settings))
    try:
        procs.wait_for_port(port, timeout_s=30)
        yield RunningSink(http_query_fn(f"http://127.0.0.1:{port}", token), producer, proc, log)
    finally:
        producer.flush(10)
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.popen.wait(timeout=30) == 0, log.read_text()


def test_unsigned_rewards_written_to_the_broker_leave_the_ab_report_unchanged(sink):
    rollouts, rewards = hand_made_records()
    for r in rollouts:
        sink.send_signed(topics.ROLLOUT, r.SerializeToString(), r.rollout_id)
    for r in rewards:
        sink.send_signed(topics.REWARD, r.SerializeToString(), r.rollout_id)
    sink.settle()
    honest = report.ab_table(sink.query)

    # What the issue saw: 64 treatment rewards of -1, unsigned, straight to rl.reward.v1.
    for i in range(64):
        forged = reward(rollout(f"forged-{i}", "treatment", [1], 0.1, i), True, 0.0, 1.0, -1.0)
        sink.send(topics.REWARD, forged.SerializeToString(), forged.rollout_id)
    sink.settle()

    assert report.ab_table(sink.query) == honest
    assert sink.query("SELECT count() AS n FROM rewards FINAL") == [{"n": len(rewards)}]
    assert sink.dead_letters(topics.REWARD) == {
        f"forged-{i}": "reward not authenticated by the joiner: unsigned" for i in range(64)
    }


def test_a_rollout_unsigned_or_signed_over_other_bytes_is_not_stored(sink):
    rollouts, _ = hand_made_records()
    for r in rollouts:
        sink.send_signed(topics.ROLLOUT, r.SerializeToString(), r.rollout_id)
    unsigned = rollout("forged-unsigned", "treatment", [1], 9.0, 0)
    sink.send(topics.ROLLOUT, unsigned.SerializeToString(), unsigned.rollout_id)
    # A worker's real signature, lifted from the record it was made for.
    lifted = rollout("forged-lifted", "treatment", [1], 9.0, 0)
    real = signed.headers(topics.ROLLOUT, rollouts[0].SerializeToString())
    sink.send(topics.ROLLOUT, lifted.SerializeToString(), lifted.rollout_id, real)
    sink.settle()

    stored = sink.query("SELECT rollout_id FROM rollouts FINAL ORDER BY rollout_id")
    assert [r["rollout_id"] for r in stored] == sorted(r.rollout_id for r in rollouts)
    assert sink.dead_letters(topics.ROLLOUT) == {
        "forged-unsigned": "rollout not signed by an inference worker: unsigned",
        "forged-lifted": "rollout not signed by an inference worker: bad signature",
    }


def test_an_event_without_the_sinks_mac_is_not_stored(sink):
    def event(rollout_id: str) -> telemetry_pb2.TelemetryEvent:
        return make_event(rollout_id, "s1", "u1", followup=telemetry_pb2.FollowUp(message="no"))

    honest = event("honest")
    sink.send_signed(topics.FOLLOWUP, honest.SerializeToString(), honest.rollout_id)
    no_mac = event("forged-no-mac")
    sink.send(topics.FOLLOWUP, no_mac.SerializeToString(), no_mac.rollout_id)
    # The joiner's MAC only: a key the gateway shares with another reader vouches for nothing here.
    joiners = event("forged-joiner-mac")
    joiner_mac = signing.MacSigner(os.environ["RTRL_INGEST_EVENT_KEY"], signing.Purpose.EVENT)
    value = joiners.SerializeToString()
    sink.send(topics.FOLLOWUP, value, joiners.rollout_id, joiner_mac.headers(value))
    sink.settle()

    assert sink.query("SELECT rollout_id FROM telemetry_events FINAL") == [{"rollout_id": "honest"}]
    letters = sink.dead_letters(topics.FOLLOWUP)
    assert letters.keys() == {"forged-no-mac", "forged-joiner-mac"}
    assert letters["forged-no-mac"] == "event not authenticated by the ingest gateway: unsigned"
    assert letters["forged-joiner-mac"].startswith(
        "event not authenticated by the ingest gateway: no MAC under this reader's key"
    )


def test_a_trainer_step_the_trainer_did_not_sign_is_not_in_the_training_report(sink):
    def step(n: int) -> trainer_pb2.TrainerStep:
        return trainer_pb2.TrainerStep(
            step_id=f"warm:{n}", lineage="warm", step=n, version=n, ts_ms=1_800_000_000_000
        )

    sink.send_signed(topics.TRAINER_STEPS, step(1).SerializeToString(), "warm")
    sink.send(topics.TRAINER_STEPS, step(2).SerializeToString(), "forged-unsigned")
    # The trainer's key, but a manifest's signature: no purpose vouches for another.
    manifest = signing.Signer(
        os.environ["RTRL_TRAINER_MANIFEST_SIGNING_KEY"], signing.Purpose.MANIFEST
    )
    value = step(3).SerializeToString()
    sink.send(topics.TRAINER_STEPS, value, "forged-manifest-sig", manifest.headers(value))
    sink.settle()

    assert [s["step"] for s in training_report.trainer_steps(sink.query)] == [1]
    assert sink.dead_letters(topics.TRAINER_STEPS) == {
        "forged-unsigned": "trainer step not signed by the trainer: unsigned",
        "forged-manifest-sig": "trainer step not signed by the trainer: bad signature",
    }
