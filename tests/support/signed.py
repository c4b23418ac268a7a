"""Records as their writers sign them, for tests that feed the analytics sink, which stores
only what verifies (analytics/authn.py): a worker's rollout, the joiner's rewards and late
records, the gateway's events, the trainer's steps. Keys: tests/conftest.py."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import cast

from confluent_kafka import Consumer, Producer

from rtrl import kafka, signing, topics
from rtrl.analytics.authn import Authenticator
from rtrl.analytics.config import AnalyticsSettings
from rtrl.analytics.rows import KafkaRecord
from rtrl.analytics.sink import Sink
from rtrl.config import StackSettings
from rtrl.reward_stream.config import RewardStreamSettings
from support.analytics import RecordingConsumer
from support.signing import worker_headers

SINK_AUTHENTICATOR = Authenticator.of(AnalyticsSettings(), StackSettings())
"""The sink's check, with the keys tests/conftest.py gives the analytics process."""


def checking_sink(client, consumer: object | None = None, batch_size: int = 100) -> Sink:
    """A sink writing to ``client`` that checks every record as the service does; it commits
    through ``consumer`` (a RecordingConsumer, minus Kafka, unless given)."""
    return Sink(
        cast(Consumer, consumer if consumer is not None else RecordingConsumer()),
        client,
        authenticator=SINK_AUTHENTICATOR,
        batch_size=batch_size,
        flush_interval_s=1.0,
    )


_JOINER = RewardStreamSettings()
REWARD_SIGNER = _JOINER.reward_seal()
"""As the joiner seals a reward: a MAC for the trainer and one for the sink."""
LATE_SIGNER = _JOINER.late_seal()
STEP_SIGNER = signing.Signer(
    os.environ["RTRL_TRAINER_MANIFEST_SIGNING_KEY"], signing.Purpose.TRAINER_STEP
)
_SIGNERS: dict[str, signing.HeaderSigner] = {
    topics.REWARD: REWARD_SIGNER,
    topics.REWARD_LATE: LATE_SIGNER,
    topics.TRAINER_STEPS: STEP_SIGNER,
}


def headers(
    topic: str, value: bytes, extra: Sequence[tuple[str, bytes]] = ()
) -> tuple[tuple[str, bytes], ...]:
    """``extra`` and the headers ``topic``'s writer authenticates ``value`` with; none on the
    dead-letter topic, whose writers sign nothing."""
    if topic in topics.TELEMETRY:
        return (*extra, *worker_headers(topic, value))
    signer = _SIGNERS.get(topic)
    return (*extra, *signer.headers(value)) if signer is not None else tuple(extra)


def record(
    topic: str,
    partition: int,
    offset: int,
    key: bytes | None,
    value: bytes,
    extra: Sequence[tuple[str, bytes]] = (),
) -> KafkaRecord:
    """What the sink reads when ``topic``'s writer wrote ``value`` (with ``extra`` headers)."""
    return KafkaRecord(topic, partition, offset, key, value, headers(topic, value, extra))


def produce(
    producer: Producer,
    topic: str,
    value: bytes,
    key: str,
    extra: Sequence[tuple[str, bytes]] = (),
) -> None:
    """Produce ``value`` as ``topic``'s writer would (see headers)."""
    producer.produce(
        topic, value, key=key, headers=kafka.kafka_headers(headers(topic, value, extra))
    )
