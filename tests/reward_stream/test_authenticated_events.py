"""A user's signal reaches a reward only through the ingest gateway (guarantee 7, the
events' half).

A telemetry event says what a user did with an edit: kept it, rewrote it, complained.
Anyone who reaches the embedded broker (it has no ACLs) could write such events for any
rollout id and steer its reward, and so the policy. The gateway authenticates every
event it writes (an HMAC under the event key it shares with the joiner alone); the
joiner checks each before it decodes it. First the pure join, with one forgery of each
kind aimed at an honest rollout, then the joiner service with forgeries produced straight
to the broker beside honest traffic: each forgery is dead-lettered with its reason and
counted, and every reward is what the honest events alone make it.
"""

from __future__ import annotations

import os
import time

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
from support.signing import EVENT_SIGNER, worker_headers

Headers = list[tuple[str, bytes]]


def _rollout(rollout_id: str, ts_ms: int) -> rollout_pb2.RolloutRecord:
    return rollout_pb2.RolloutRecord(
        event_id=f"{rollout_id}-r", rollout_id=rollout_id, client_ts_ms=ts_ms, completion_text="x = 1\n",
        arm=common_pb2.ARM_TREATMENT, completion_token_ids=[5, 6, 7], completion_logprobs=[-0.1, -0.2, -0.3],
    )  # fmt: skip


def _kept(rollout_id: str, ts_ms: int) -> telemetry_pb2.TelemetryEvent:
    return telemetry_pb2.TelemetryEvent(
        event_id=f"{rollout_id}-kept", rollout_id=rollout_id, client_ts_ms=ts_ms + 1,
        persistence=telemetry_pb2.PersistenceSnapshot(seconds_after_edit=30, region_text="x = 1\n"),
    )  # fmt: skip


def _anger(rollout_id: str, ts_ms: int, n: int) -> telemetry_pb2.TelemetryEvent:
    """What a forger writes to drag a rollout's reward down."""
    return telemetry_pb2.TelemetryEvent(
        event_id=f"{rollout_id}-anger-{n}", rollout_id=rollout_id, client_ts_ms=ts_ms + 2 + n,
        followup=telemetry_pb2.FollowUp(seconds_after_edit=5, message="this is wrong, undo it, terrible"),
    )  # fmt: skip


def _forgeries(rollout_id: str, ts_ms: int) -> list[tuple[bytes, Headers, str]]:
    """(value, headers, the reason it is refused) of each kind of forged event."""
    stranger = signing.MacSigner(signing.generate_mac_key(), signing.Purpose.EVENT)
    values = [_anger(rollout_id, ts_ms, n).SerializeToString() for n in range(5)]
    # The gateway's MAC of an honest event, carried by another one.
    replayed = list(EVENT_SIGNER.headers(_kept(rollout_id, ts_ms).SerializeToString()))
    # The joiner's key id, with a tag made under another key: nothing the key made.
    joiners = signing.MacSigner(os.environ["RTRL_INGEST_EVENT_KEY"], signing.Purpose.EVENT)
    borrowed = [(signing.MAC_HEADER, joiners.key_id.encode() + stranger.sign(values[3]))]
    # The gateway's MAC for the analytics sink alone: the sink's key makes nothing the joiner takes.
    for_the_sink = signing.MacSigner(
        os.environ["RTRL_INGEST_ANALYTICS_EVENT_KEY"], signing.Purpose.EVENT
    )
    return [
        (values[0], [], signing.UNSIGNED),
        (values[1], list(stranger.headers(values[1])), "no MAC under this reader's key"),
        (values[2], replayed, "bad signature"),
        (values[3], borrowed, "bad signature"),
        (values[4], list(for_the_sink.headers(values[4])), "no MAC under this reader's key"),
    ]


def _settled(joiner: Joiner, records: list[tuple[str, bytes, Headers]], ts: int):
    """Feed (topic, value, headers) of one rollout in order; (its rewards, the DLQ's reasons)."""
    reasons = []
    for offset, (topic, value, headers) in enumerate(records):
        for out in joiner.feed_record(topic, 0, offset, b"r1", value, ts, headers=headers).records:
            assert out.topic == topics.REWARD_DLQ
            reasons.append(dict(out.headers)["error"].decode())
    rewards = [
        reward_pb2.RewardRecord.FromString(r.value)
        for r in joiner.tick(ts + 120_000)
        if r.topic == topics.REWARD
    ]
    return rewards, reasons


def test_the_join_refuses_every_forged_event_and_the_reward_is_the_honest_ones():
    settings = RewardStreamSettings(window_s=1, grace_s=0)
    ts = 1_800_000_000_000
    rollout = _rollout("r1", ts).SerializeToString()
    kept = _kept("r1", ts).SerializeToString()
    honest = [
        (topics.ROLLOUT, rollout, worker_headers(topics.ROLLOUT, rollout)),
        (topics.PERSISTENCE, kept, worker_headers(topics.PERSISTENCE, kept)),
    ]
    forged = _forgeries("r1", ts)

    def joiner() -> Joiner:
        return Joiner(settings.join_config(), authenticator=Authenticator.of(settings))

    (alone,), none = _settled(joiner(), honest, ts)
    assert none == [] and alone.components.persisted_fraction == 1.0
    guarded = joiner()
    (attacked,), reasons = _settled(
        guarded, [*honest, *((topics.FOLLOWUP, v, h) for v, h, _ in forged)], ts
    )
    assert len(reasons) == len(forged)
    for got, (_, _, reason) in zip(reasons, forged, strict=True):
        assert got.startswith(f"event not authenticated by the ingest gateway: {reason}"), got
    assert guarded.counters.unauthenticated == len(forged) == guarded.counters.dlq
    assert attacked.reward == alone.reward and list(attacked.event_ids) == list(alone.event_ids)
    # The check is what stands between them: unguarded, the same forgeries drag it down.
    (steered,), _ = _settled(
        Joiner(settings.join_config()),
        [*honest, *((topics.FOLLOWUP, v, h) for v, h, _ in forged)],
        ts,
    )
    assert steered.reward < alone.reward and steered.components.dissatisfied > 0


@pytest.mark.guarantee(7)
@pytest.mark.integration
@pytest.mark.timeout(180)
def test_the_joiner_service_lets_no_event_produced_straight_to_the_broker_steer_a_reward(
    stack_settings, stack_env, redis_url, tmp_path
):
    service = spawn_joiner(stack_env, tmp_path)
    try:
        ts = int(time.time() * 1000)
        honest = [f"honest-{i}" for i in range(4)]
        forged: dict[str, str] = {}
        producer = Producer(kafka.producer_config(stack_settings))

        def produce(topic: str, rollout_id: str, value: bytes, headers: Headers) -> None:
            producer.produce(topic, value, key=rollout_id, headers=kafka.kafka_headers(headers))

        for rollout_id in honest:
            for topic, message in ((topics.ROLLOUT, _rollout(rollout_id, ts)),
                                   (topics.PERSISTENCE, _kept(rollout_id, ts))):  # fmt: skip
                value = message.SerializeToString()
                produce(topic, rollout_id, value, worker_headers(topic, value))
            for value, headers, reason in _forgeries(rollout_id, ts):
                forged[telemetry_pb2.TelemetryEvent.FromString(value).event_id] = reason
                produce(topics.FOLLOWUP, rollout_id, value, headers)
        assert producer.flush(10) == 0
        producer.close()

        beat = wait_for_settled(redis_url, settled=len(honest), refused=len(forged))
        assert beat.unauthenticated == len(forged) == beat.dlq

        out = replay.read_retained(stack_settings, (topics.REWARD, topics.REWARD_DLQ))
        rewards = [
            reward_pb2.RewardRecord.FromString(r.value or b"")
            for r in out
            if r.topic == topics.REWARD
        ]
        assert sorted(r.rollout_id for r in rewards) == sorted(honest)
        for r in rewards:  # kept, and nobody complained: the forgeries count for nothing
            assert (r.components.persisted_fraction, r.components.dissatisfied) == (1.0, 0.0)
            assert sorted(r.event_ids) == [f"{r.rollout_id}-kept", f"{r.rollout_id}-r"], r
        dead = {
            telemetry_pb2.TelemetryEvent.FromString(r.value or b"").event_id: dict(r.headers)[
                "error"
            ]
            for r in out
            if r.topic == topics.REWARD_DLQ
        }
        assert set(dead) == set(forged)
        for event_id, reason in forged.items():
            got = (dead[event_id] or b"").decode()
            assert got.startswith(f"event not authenticated by the ingest gateway: {reason}"), got
    finally:
        service.stop(timeout_s=20)
    assert service.popen.returncode == 0, (tmp_path / "reward_stream.log").read_text()[-3000:]
