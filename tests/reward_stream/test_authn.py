"""The joiner's authenticator is an allow-list of topics (reward_stream/authn.py): each topic
the join reads names its writer, and a record from any other topic is refused as having no
known writer, even one that carries a valid signature or MAC. No topic falls through to
another topic's check."""

from __future__ import annotations

import pytest

from rtrl import topics
from rtrl.reward_stream.authn import Authenticator
from rtrl.reward_stream.config import RewardStreamSettings
from rtrl.reward_stream.runtime import Joiner
from rtrl.v1 import common_pb2, reward_pb2, rollout_pb2
from rtrl_client.v1 import telemetry_pb2
from support.signing import EVENT_SIGNER, ROLLOUT_SIGNER, worker_headers

TS = 1_800_000_000_000
ROLLOUT = rollout_pb2.RolloutRecord(
    event_id="r1-r", rollout_id="r1", client_ts_ms=TS, completion_text="x = 1\n",
    arm=common_pb2.ARM_TREATMENT, completion_token_ids=[5, 6, 7], completion_logprobs=[-0.1, -0.2, -0.3],
).SerializeToString()  # fmt: skip
KEPT = telemetry_pb2.TelemetryEvent(
    event_id="r1-kept", rollout_id="r1", client_ts_ms=TS + 1,
    persistence=telemetry_pb2.PersistenceSnapshot(seconds_after_edit=30, region_text="x = 1\n"),
).SerializeToString()  # fmt: skip
ANGER = telemetry_pb2.TelemetryEvent(
    event_id="r1-anger", rollout_id="r1", client_ts_ms=TS + 2,
    followup=telemetry_pb2.FollowUp(seconds_after_edit=5, message="this is wrong, undo it, terrible"),
).SerializeToString()  # fmt: skip
NO_WRITER = "no writer is known for topic"


def authenticator() -> Authenticator:
    return Authenticator.of(RewardStreamSettings())


def test_every_topic_the_join_reads_names_its_writer_and_no_other_topic_does():
    assert set(authenticator().writers) == set(topics.TELEMETRY)


# (topic, value, headers, the start of the refusal or None if accepted). Each case is a
# record carrying a valid signature or MAC by a real writer, on a topic it may or may not write.
CASES = [
    # Each writer on its own topics.
    (topics.ROLLOUT, ROLLOUT, ROLLOUT_SIGNER.headers(ROLLOUT), None),
    (topics.PERSISTENCE, KEPT, EVENT_SIGNER.headers(KEPT), None),
    (topics.FOLLOWUP, ANGER, EVENT_SIGNER.headers(ANGER), None),
    # The gateway's MAC does not make a rollout, nor a worker's signature an event.
    (topics.ROLLOUT, ROLLOUT, EVENT_SIGNER.headers(ROLLOUT), "rollout not signed by an inference worker"),
    (topics.EDIT, KEPT, ROLLOUT_SIGNER.headers(KEPT), "event not authenticated by the ingest gateway"),
    # Topics the join does not read, however well signed: a look-alike, the join's own
    # output, a later schema version. Before the allow-list they fell to the events' check.
    ("telemetry.followup.v1 ", ANGER, EVENT_SIGNER.headers(ANGER), NO_WRITER),
    (topics.REWARD, ANGER, EVENT_SIGNER.headers(ANGER), NO_WRITER),
    ("telemetry.followup.v2", ANGER, EVENT_SIGNER.headers(ANGER), NO_WRITER),
    ("", ROLLOUT, ROLLOUT_SIGNER.headers(ROLLOUT), NO_WRITER),
]  # fmt: skip


@pytest.mark.parametrize(("topic", "value", "headers", "refusal"), CASES)
def test_a_record_is_checked_against_its_topics_writer_only(topic, value, headers, refusal):
    problem = authenticator().problem(topic, value, list(headers))
    if refusal is None:
        assert problem is None
    else:
        assert problem is not None and problem.startswith(refusal), problem


def test_a_signed_complaint_on_a_topic_the_joiner_does_not_know_is_dead_lettered_not_joined():
    """The attack: an event the gateway did authenticate (a replayed complaint, say),
    written to a topic the join does not read, to drag an honest rollout's reward down."""
    settings = RewardStreamSettings(window_s=1, grace_s=0)
    joiner = Joiner(settings.join_config(), authenticator=Authenticator.of(settings))
    honest = [(topics.ROLLOUT, ROLLOUT), (topics.PERSISTENCE, KEPT)]
    smuggled = "telemetry.followup.v2"
    dead = []
    for offset, (topic, value) in enumerate([*honest, (smuggled, ANGER)]):
        headers = worker_headers(topic, value)
        for out in joiner.feed_record(topic, 0, offset, b"r1", value, TS, headers=headers).records:
            assert out.topic == topics.REWARD_DLQ
            dead.append(dict(out.headers))
    (letter,) = dead
    assert letter["error"].decode().startswith(f"{NO_WRITER} {smuggled!r}")
    assert letter["source_topic"] == smuggled.encode()
    assert joiner.counters.unauthenticated == 1 == joiner.counters.dlq
    (reward,) = [
        reward_pb2.RewardRecord.FromString(r.value)
        for r in joiner.tick(TS + 120_000)
        if r.topic == topics.REWARD
    ]
    assert reward.components.dissatisfied == 0 and "r1-anger" not in reward.event_ids
