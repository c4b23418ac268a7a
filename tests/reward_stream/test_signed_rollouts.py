"""A reward is only ever built on a rollout an inference worker served (guarantee 7,
the rollouts' half).

The embedded broker lets anyone write to telemetry.rollout.v1, and a rollout names the
tokens the trainer will push up or down. Workers sign every rollout record
(inference/server.py); the joiner verifies each before it decodes it. First the pure
join with one forgery of each kind, then the joiner service with forgeries produced
straight to the broker beside honest traffic: no reward for any forgery, each
dead-lettered with its reason and counted.
"""

from __future__ import annotations

import os
import time
import uuid

import pytest
from confluent_kafka import Producer

from rtrl import kafka, signing, topics
from rtrl.reward_stream import replay
from rtrl.reward_stream.authn import Authenticator
from rtrl.reward_stream.config import RewardStreamSettings
from rtrl.reward_stream.runtime import Joiner
from rtrl.v1 import common_pb2, reward_pb2, rollout_pb2
from rtrl_client.v1 import telemetry_pb2
from support.beats import wait_for_settled
from support.reward_stream import spawn_joiner
from support.signing import ROLLOUT_SIGNER, produce_as_its_writer, worker_headers


def _present(value: bytes | None) -> bytes:
    """A field of a read-back record that the test knows is set (typed Optional)."""
    assert value is not None
    return value


def _rollout(rollout_id: str, ts_ms: int) -> rollout_pb2.RolloutRecord:
    return rollout_pb2.RolloutRecord(
        event_id=f"{rollout_id}-r", rollout_id=rollout_id, client_ts_ms=ts_ms, completion_text="x = 1\n",
        arm=common_pb2.ARM_TREATMENT, completion_token_ids=[5, 6, 7], completion_logprobs=[-0.1, -0.2, -0.3],
    )  # fmt: skip


def _kept(rollout_id: str, ts_ms: int) -> telemetry_pb2.TelemetryEvent:
    return telemetry_pb2.TelemetryEvent(
        event_id=f"{rollout_id}-p", rollout_id=rollout_id, client_ts_ms=ts_ms + 1,
        persistence=telemetry_pb2.PersistenceSnapshot(seconds_after_edit=30, region_text="x = 1\n"),
    )  # fmt: skip


def _forgeries(ts_ms: int) -> dict[str, tuple[bytes, list[tuple[str, bytes]], str]]:
    """rollout_id -> (value, headers, the reason it is refused)."""
    stranger = signing.MacSigner(signing.generate_mac_key(), signing.Purpose.ROLLOUT)
    to_joiner = signing.MacSigner(
        os.environ["RTRL_INFERENCE_ROLLOUT_MAC_KEY"], signing.Purpose.ROLLOUT
    )
    # The worker's own Ed25519 signature is for the analytics sink: it is no MAC the joiner holds.
    worker_signature = signing.Signer(
        os.environ["RTRL_INFERENCE_ROLLOUT_SIGNING_KEY"], signing.Purpose.ROLLOUT
    )
    forged: dict[str, tuple[bytes, list[tuple[str, bytes]], str]] = {}

    def value(rollout_id: str) -> bytes:
        return _rollout(rollout_id, ts_ms).SerializeToString()

    forged["unsigned"] = (value("unsigned"), [], signing.UNSIGNED)
    forged["stranger"] = (
        value("stranger"),
        list(stranger.headers(value("stranger"))),
        "no MAC under this reader's key",
    )
    forged["signature-only"] = (
        value("signature-only"),
        list(worker_signature.headers(value("signature-only"))),
        "signed by an unknown key",
    )
    # An honest signature, on other bytes: the tokens rewritten after signing.
    tampered = _rollout("tampered", ts_ms)
    honest_headers = list(ROLLOUT_SIGNER.headers(tampered.SerializeToString()))
    tampered.completion_token_ids[:] = [66, 66, 66]
    forged["tampered"] = (tampered.SerializeToString(), honest_headers, "bad signature")
    # Another honest rollout's signature replayed onto this one.
    forged["replayed"] = (
        value("replayed"),
        list(ROLLOUT_SIGNER.headers(value("someone-else"))),
        "bad signature",
    )
    # The workers' key, but a MAC made for another purpose (a reward's).
    as_reward = signing.MacSigner(
        os.environ["RTRL_INFERENCE_ROLLOUT_MAC_KEY"], signing.Purpose.REWARD
    ).headers(value("purpose"))
    forged["purpose"] = (value("purpose"), list(as_reward), "bad signature")
    # The workers' key id with a tag made under another key.
    forged["borrowed-id"] = (
        value("borrowed-id"),
        [(signing.MAC_HEADER, to_joiner.key_id.encode() + stranger.sign(value("borrowed-id")))],
        "bad signature",
    )
    return forged


def test_the_join_refuses_every_forged_rollout_and_settles_the_honest_one():
    settings = RewardStreamSettings(window_s=1, grace_s=0)
    joiner = Joiner(settings.join_config(), authenticator=Authenticator.of(settings))
    ts = 1_800_000_000_000
    offset = 0
    dead: dict[str, str] = {}
    for rollout_id, (value, headers, _) in _forgeries(ts).items():
        for record in joiner.feed_record(
            topics.ROLLOUT, 0, offset, rollout_id.encode(), value, ts, headers=headers
        ).records:
            assert record.topic == topics.REWARD_DLQ
            dead[record.key.decode()] = dict(record.headers)["error"].decode()
        offset += 1
    honest = _rollout("honest", ts).SerializeToString()
    assert (
        joiner.feed_record(
            topics.ROLLOUT,
            0,
            offset,
            b"honest",
            honest,
            ts,
            headers=worker_headers(topics.ROLLOUT, honest),
        ).records
        == []
    )
    expected = {rollout_id: reason for rollout_id, (_, _, reason) in _forgeries(ts).items()}
    assert set(dead) == set(expected)
    for rollout_id, reason in expected.items():
        assert dead[rollout_id].startswith(
            f"rollout not signed by an inference worker: {reason}"
        ), (rollout_id, dead[rollout_id])
    assert joiner.counters.unauthenticated == len(expected) and joiner.counters.dlq == len(expected)
    settled = [
        reward_pb2.RewardRecord.FromString(r.value)
        for r in joiner.tick(ts + 60_000)
        if r.topic == topics.REWARD
    ]
    assert [r.rollout_id for r in settled] == ["honest"]


@pytest.mark.guarantee(7)
@pytest.mark.integration
@pytest.mark.timeout(180)
def test_the_joiner_service_builds_no_reward_on_a_rollout_produced_straight_to_the_broker(
    stack_settings, stack_env, redis_url, tmp_path
):
    # The forger's telemetry waits max_wait_s for a rollout that never comes: 5 s here,
    # not the hour an agent's record may take to be written.
    service = spawn_joiner(stack_env, tmp_path, max_wait_s="5")
    try:
        ts = int(time.time() * 1000)
        forged = _forgeries(ts)
        honest = [f"honest-{uuid.uuid4().hex[:8]}" for _ in range(4)]
        producer = Producer(kafka.producer_config(stack_settings))
        for rollout_id in honest:
            value = _rollout(rollout_id, ts).SerializeToString()
            produce_as_its_writer(producer, topics.ROLLOUT, value, rollout_id)
            kept = _kept(rollout_id, ts).SerializeToString()
            produce_as_its_writer(producer, topics.PERSISTENCE, kept, rollout_id)
        for rollout_id, (value, headers, _) in forged.items():
            producer.produce(
                topics.ROLLOUT, value, key=rollout_id, headers=kafka.kafka_headers(headers)
            )
            # The forger reports the edit kept, through the gateway: telemetry without a
            # rollout joins nothing.
            kept = _kept(rollout_id, ts).SerializeToString()
            produce_as_its_writer(producer, topics.PERSISTENCE, kept, rollout_id)
        assert producer.flush(10) == 0

        beat = wait_for_settled(redis_url, settled=len(honest), refused=len(forged))
        assert beat.unauthenticated == len(forged)

        out = replay.read_retained(stack_settings, (topics.REWARD, topics.REWARD_DLQ))
        rewarded = sorted(
            reward_pb2.RewardRecord.FromString(_present(r.value)).rollout_id
            for r in out
            if r.topic == topics.REWARD
        )
        assert rewarded == sorted(honest)
        reasons = {
            _present(r.key).decode(): _present(dict(r.headers)["error"]).decode()
            for r in out
            if r.topic == topics.REWARD_DLQ
        }
        for rollout_id, (_, _, reason) in forged.items():
            assert reasons[rollout_id].startswith(
                f"rollout not signed by an inference worker: {reason}"
            ), reasons
    finally:
        service.stop(timeout_s=20)
    assert service.popen.returncode == 0, (tmp_path / "reward_stream.log").read_text()[-3000:]


def test_only_the_served_clients_telemetry_counts_toward_a_reward():
    """An event names a rollout by id; the gateway stamps it with the client_id of the key it
    came with, and the join counts it only toward a rollout served to that client."""
    joiner = Joiner(RewardStreamSettings(window_s=1, grace_s=0).join_config())
    ts = 1_800_000_000_000
    rollouts = {}
    for rollout_id in ("served-to-editor", "served-without-keys"):
        record = _rollout(rollout_id, ts)
        record.client_id = "editor" if rollout_id == "served-to-editor" else ""
        rollouts[rollout_id] = record
    offset = 0
    for rollout_id, record in rollouts.items():
        joiner.feed_record(
            topics.ROLLOUT, 0, offset, rollout_id.encode(), record.SerializeToString(), ts
        )
        kept = _kept(rollout_id, ts)
        kept.client_id = "intruder"
        joiner.feed_record(
            topics.PERSISTENCE, 0, offset + 1, rollout_id.encode(), kept.SerializeToString(), ts
        )
        offset += 2
    settled = {
        r.rollout_id: r
        for r in (
            reward_pb2.RewardRecord.FromString(o.value)
            for o in joiner.tick(ts + 60_000)
            if o.topic == topics.REWARD
        )
    }
    # The intruder's "kept" moved nothing: the editor's rollout settles as if no one had reported.
    assert settled["served-to-editor"].defaulted and settled["served-to-editor"].event_ids == [
        "served-to-editor-r"
    ]
    assert not settled[
        "served-without-keys"
    ].defaulted  # served without keys: anyone's telemetry counts
    assert joiner.counters.foreign == 1
