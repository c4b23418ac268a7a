"""The sink's allow-list of writers (analytics/authn.py), case by case, and what the sink does
with a record it refuses: a dead letter with the reason, committed past like any other."""

from __future__ import annotations

import os

import pytest

from rtrl import signing, topics
from rtrl.analytics import schema
from rtrl.analytics.authn import DEAD_LETTER, Authenticator
from rtrl.analytics.config import AnalyticsSettings
from rtrl.analytics.query import client_query_fn, connect
from rtrl.analytics.rows import KafkaRecord
from rtrl.config import StackSettings
from support import signed
from support.analytics import RecordingConsumer, hand_made_records

VALUE = b"\x0a\x02r1 any bytes: nothing is decoded before its writer is checked"
MANIFEST_KEY = os.environ["RTRL_TRAINER_MANIFEST_SIGNING_KEY"]


def sig(key: str, purpose: signing.Purpose) -> tuple[tuple[str, bytes], ...]:
    return tuple(signing.Signer(key, purpose).headers(VALUE))


def mac(variable: str, purpose: signing.Purpose) -> tuple[tuple[str, bytes], ...]:
    return signing.MacSigner(os.environ[variable], purpose).headers(VALUE)


ROLLOUT_REFUSED = "rollout not signed by an inference worker: "
REWARD_REFUSED = "reward not authenticated by the joiner: "
LATE_REFUSED = "late record not authenticated by the joiner: "
EVENT_REFUSED = "event not authenticated by the ingest gateway: "
STEP_REFUSED = "trainer step not signed by the trainer: "
OTHER_READER = "no MAC under this reader's key"
REWARD, EVENT = signing.Purpose.REWARD, signing.Purpose.EVENT
ANALYTICS_MAC = "RTRL_REWARD_ANALYTICS_MAC_KEY"

# topic, the headers it arrives with, what the sink says (None: stored); one comment per idea.
CASES = [
    (topics.ROLLOUT, signed.headers(topics.ROLLOUT, VALUE), None),
    (topics.ROLLOUT, (), ROLLOUT_REFUSED + signing.UNSIGNED),
    # the trainer's key is no worker's
    (topics.ROLLOUT, sig(MANIFEST_KEY, signing.Purpose.ROLLOUT), ROLLOUT_REFUSED + "signed by an"),
    (topics.REWARD, signed.headers(topics.REWARD, VALUE), None),
    (topics.REWARD, (), REWARD_REFUSED + signing.UNSIGNED),
    # the MAC the joiner makes for the trainer vouches for nothing to the sink
    (topics.REWARD, mac("RTRL_REWARD_TRAINER_MAC_KEY", REWARD), REWARD_REFUSED + OTHER_READER),
    (topics.REWARD, mac("RTRL_REWARD_ANALYTICS_MAC_KEY", REWARD), None),
    # the joiner's late record passed off as a reward, and a reward as a late record
    (topics.REWARD, mac(ANALYTICS_MAC, signing.Purpose.REWARD_LATE), REWARD_REFUSED + "bad"),
    (topics.REWARD_LATE, signed.headers(topics.REWARD_LATE, VALUE), None),
    (topics.REWARD_LATE, (), LATE_REFUSED + signing.UNSIGNED),
    (topics.REWARD_LATE, mac(ANALYTICS_MAC, REWARD), LATE_REFUSED + "bad signature"),
    *[(topic, signed.headers(topic, VALUE), None) for topic in topics.BY_PAYLOAD.values()],
    (topics.EDIT, (), EVENT_REFUSED + signing.UNSIGNED),
    # the MAC the gateway makes for the joiner vouches for nothing to the sink
    (topics.FOLLOWUP, mac("RTRL_INGEST_EVENT_KEY", EVENT), EVENT_REFUSED + OTHER_READER),
    (topics.PERSISTENCE, mac("RTRL_INGEST_ANALYTICS_EVENT_KEY", EVENT), None),
    (topics.TRAINER_STEPS, signed.headers(topics.TRAINER_STEPS, VALUE), None),
    (topics.TRAINER_STEPS, (), STEP_REFUSED + signing.UNSIGNED),
    # the trainer's key, a manifest's signature
    (topics.TRAINER_STEPS, sig(MANIFEST_KEY, signing.Purpose.MANIFEST), STEP_REFUSED + "bad"),
    # a dead letter is never vouched for, whatever it carries
    (topics.REWARD_DLQ, (), DEAD_LETTER.reason),
    (topics.REWARD_DLQ, signed.headers(topics.REWARD, VALUE), DEAD_LETTER.reason),
    # a topic the sink does not read has no writer, not a default one
    ("rl.reward.replay.r2", signed.headers(topics.REWARD, VALUE), "no writer is known for topic"),
]


@pytest.mark.parametrize(("topic", "headers", "expected"), CASES)
def test_a_record_is_stored_only_if_its_topics_writer_vouched_for_it(topic, headers, expected):
    problem = signed.SINK_AUTHENTICATOR.problem(topic, VALUE, headers)
    if expected is None:
        assert problem is None
    else:
        assert problem is not None and problem.startswith(expected), problem


def test_every_topic_the_sink_reads_names_its_writer():
    assert set(signed.SINK_AUTHENTICATOR.writers) == set(topics.ALL)


def test_a_header_without_a_value_is_no_signature():
    headers = ((signing.SIGNATURE_HEADER, None), (signing.SIGNER_HEADER, None))
    problem = signed.SINK_AUTHENTICATOR.problem(topics.REWARD, VALUE, headers)
    assert problem == REWARD_REFUSED + signing.UNSIGNED


@pytest.mark.parametrize("empty", ["rollout_public_keys", "reward_mac_keys", "event_keys"])
def test_no_authenticator_without_every_key(empty):
    with pytest.raises(ValueError, match="needs at least one"):
        Authenticator.of(AnalyticsSettings.model_validate({empty: ""}), StackSettings())


@pytest.mark.integration
def test_a_refused_record_is_a_dead_letter_and_its_offset_is_committed(tmp_path):
    client = connect(StackSettings(state_dir=tmp_path))
    try:
        schema.create_tables(client)
        consumer = RecordingConsumer()
        sink = signed.checking_sink(client, consumer)
        rollouts, rewards = hand_made_records()
        honest, forged = rewards[0].SerializeToString(), rewards[1].SerializeToString()
        sink.add(signed.record(topics.ROLLOUT, 0, 0, b"c1", rollouts[0].SerializeToString()))
        sink.add(signed.record(topics.REWARD, 1, 7, b"c1", honest))
        sink.add(KafkaRecord(topics.REWARD, 1, 8, b"c2", forged))
        sink.flush()

        assert consumer.commits == [{(topics.ROLLOUT, 0): 1, (topics.REWARD, 1): 9}]
        assert sink.refused == {topics.REWARD: 1}
        assert dict(sink.inserted) == {
            schema.ROLLOUTS: 1,
            schema.REWARDS: 1,
            schema.DEAD_LETTERS: 1,
        }
        query = client_query_fn(client)
        assert query("SELECT reward_id FROM rewards FINAL") == [{"reward_id": "rw-c1"}]
        assert query("SELECT topic, offset, key, reason FROM dead_letters FINAL") == [
            {
                "topic": topics.REWARD,
                "offset": 8,
                "key": "c2",
                "reason": REWARD_REFUSED + signing.UNSIGNED,
            }
        ]
    finally:
        client.close()
