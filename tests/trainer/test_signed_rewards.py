"""Rewards that steer training are the joiner's, or they are not trained on (guarantee 7).

Forged reward records written straight to the broker, which the embedded Tansu lets
anyone do, reach the trainer beside honest ones: unsigned, signed by another key,
signed for another purpose, tampered with after signing, or an honest record's
signature replayed onto another. The trainer takes only the honest ones; the rest are
counted by reason and dead-lettered with it.
"""

from __future__ import annotations

import os
import time
from typing import cast

import pytest
from confluent_kafka import Consumer, Message, Producer

from rtrl import signing, topics
from rtrl.kafka import consumer_config
from rtrl.reward_stream.config import RewardStreamSettings
from rtrl.trainer.batch import Drop
from rtrl.trainer.config import TrainerSettings
from rtrl.trainer.loop import Trainer
from support.trainer import never_fetch, reward_record

HONEST = 12


def _record(reward: float = 1.0):
    return reward_record("p", [1, 5], [6, 2], [-0.5, -0.1], reward)


@pytest.mark.guarantee(7)
@pytest.mark.integration
def test_only_the_joiners_rewards_are_trained_on(stack_settings):
    joiner = RewardStreamSettings().reward_seal()
    to_trainer = signing.MacSigner(
        os.environ["RTRL_REWARD_TRAINER_MAC_KEY"], signing.Purpose.REWARD
    )
    to_sink = signing.MacSigner(os.environ["RTRL_REWARD_ANALYTICS_MAC_KEY"], signing.Purpose.REWARD)
    stranger = signing.MacSigner(signing.generate_mac_key(), signing.Purpose.REWARD)
    signer = signing.Signer(signing.generate_private_key(), signing.Purpose.REWARD)
    honest = [_record() for _ in range(HONEST)]
    # (key, value, headers, expected drop)
    forged: list[tuple[bytes, bytes, list[tuple[str, str | bytes | None]] | None, Drop]] = []

    def add(record, headers, drop: Drop) -> None:
        value = record if isinstance(record, bytes) else record.SerializeToString()
        forged.append((b"forged", value, headers, drop))

    add(_record(), None, Drop.UNSIGNED)
    add(_record(), [("rtrl-sig", b"")], Drop.UNSIGNED)
    value = _record().SerializeToString()
    add(value, list(stranger.headers(value)), Drop.FORGED)  # a key the trainer does not know
    # The sink's MAC alone: the key the sink holds cannot make a reward the trainer takes.
    add(value, list(to_sink.headers(value)), Drop.FORGED)
    add(value, list(signer.headers(value)), Drop.FORGED)  # an Ed25519 signature by anyone
    # A MAC under the trainer's key id with a tag made under another key.
    add(
        value,
        [(signing.MAC_HEADER, to_trainer.key_id.encode() + stranger.sign(value))],
        Drop.FORGED,
    )
    tampered = _record(reward=0.0)
    signed = list(joiner.headers(tampered.SerializeToString()))
    tampered.reward = 100.0  # the reward raised after the joiner signed it
    add(tampered, signed, Drop.FORGED)
    other = _record().SerializeToString()
    add(
        other, list(joiner.headers(honest[0].SerializeToString())), Drop.FORGED
    )  # another record's signature
    add(
        other,
        [
            (signing.SIGNATURE_HEADER, b"\0" * 32),
            (signing.SIGNER_HEADER, to_trainer.key_id.encode()),
        ],
        Drop.FORGED,
    )

    producer = Producer({"bootstrap.servers": stack_settings.kafka_bootstrap})
    for record in honest:
        value = record.SerializeToString()
        producer.produce(
            topics.REWARD,
            value,
            key=record.rollout_id.encode(),
            headers=list(joiner.headers(value)),
        )
    for key, value, headers, _ in forged:
        producer.produce(topics.REWARD, value, key=key, headers=headers)
    assert producer.flush(30) == 0

    dead: list[tuple[bytes, str]] = []

    def dead_letter(message: object, reason: str) -> None:
        value = cast(Message, message).value()  # the consumed record (typed object in the loop)
        assert value is not None
        dead.append((value, reason))

    settings = TrainerSettings(batch_size=64, min_batch=1)
    consumer = Consumer(consumer_config(stack_settings, "trainer-signatures"))
    trainer = Trainer(
        settings,
        stack_settings.state_dir,
        consumer,
        publishers={},
        fetch_weights=never_fetch,
        dead_letter=dead_letter,
    )
    intake = trainer.intake
    consumer.subscribe([topics.REWARD], on_assign=intake.on_assign)
    try:
        deadline = time.monotonic() + 60
        while len(intake.pending) + sum(intake.drops.values()) < HONEST + len(forged):
            assert time.monotonic() < deadline, (len(intake.pending), dict(intake.drops))
            intake.poll()
    finally:
        consumer.close()

    assert sorted(s.rollout_id for s in intake.pending) == sorted(r.rollout_id for r in honest)
    expected = {Drop.UNSIGNED: 0, Drop.FORGED: 0}
    for *_, drop in forged:
        expected[drop] += 1
    assert dict(intake.drops) == expected
    assert sorted(value for value, _ in dead) == sorted(value for _, value, _, _ in forged)
    reasons = {reason for _, reason in dead}
    assert reasons >= {"unsigned", "bad signature"}
    assert any("no MAC under this reader's key" in r for r in reasons)
    assert any("unknown key" in r for r in reasons)


def test_a_trainer_without_the_joiners_key_will_not_start(tmp_path, monkeypatch):
    monkeypatch.delenv("RTRL_TRAINER_REWARD_MAC_KEYS")
    with pytest.raises(ValueError, match="at least one key"):
        Trainer(
            TrainerSettings(), tmp_path, consumer=None, publishers={}, fetch_weights=never_fetch
        )


def test_mac_verifiers_take_both_keys_while_the_writers_key_rotates():
    old, new = signing.generate_mac_key(), signing.generate_mac_key()
    payload = b"a reward record"
    both = signing.MacVerifier([old, new], signing.Purpose.REWARD)
    for key in (old, new):
        headers = signing.MacSigner(key, signing.Purpose.REWARD).headers(payload)
        assert both.problem(payload, headers) is None
    only_new = signing.MacVerifier([new], signing.Purpose.REWARD)
    problem = only_new.problem(
        payload, signing.MacSigner(old, signing.Purpose.REWARD).headers(payload)
    )
    assert problem is not None and "no MAC under this reader's key" in problem
    # A MAC for another purpose (a rollout's) is no reward's.
    as_rollout = signing.MacSigner(new, signing.Purpose.ROLLOUT).headers(payload)
    assert only_new.problem(payload, as_rollout) == "bad signature"


def test_verifiers_take_both_keys_while_the_signers_key_rotates():
    old, new = signing.generate_private_key(), signing.generate_private_key()
    payload = b"a reward record"
    verifier = signing.Verifier(
        [signing.public_key_of(old), signing.public_key_of(new)], signing.Purpose.REWARD
    )
    for key in (old, new):
        assert (
            verifier.problem(payload, signing.Signer(key, signing.Purpose.REWARD).headers(payload))
            is None
        )
    only_new = signing.Verifier([signing.public_key_of(new)], signing.Purpose.REWARD)
    problem = only_new.problem(
        payload, signing.Signer(old, signing.Purpose.REWARD).headers(payload)
    )
    assert problem is not None and "unknown key" in problem
    with pytest.raises(ValueError, match="public key"):
        signing.parse_public_keys("not-a-key")
