"""The inference workers' rollout signature and the gateway's event MAC, for tests that
produce rollouts and events straight to Kafka as a worker or the gateway would
(tests/conftest.py generates the keys; the joiner verifies)."""

from __future__ import annotations

import os

from confluent_kafka import Producer

from rtrl import kafka, signing, topics
from rtrl.api_keys import KeyAuthority

ROLLOUT_SIGNER = signing.Seal(
    signing.Signer(os.environ["RTRL_INFERENCE_ROLLOUT_SIGNING_KEY"], signing.Purpose.ROLLOUT),
    signing.MacSigner(os.environ["RTRL_INFERENCE_ROLLOUT_MAC_KEY"], signing.Purpose.ROLLOUT),
)
"""As a worker seals a rollout: its signature and the joiner's MAC."""

EVENT_SIGNER = signing.Seal(
    signing.MacSigner(os.environ["RTRL_INGEST_EVENT_KEY"], signing.Purpose.EVENT),
    signing.MacSigner(os.environ["RTRL_INGEST_ANALYTICS_EVENT_KEY"], signing.Purpose.EVENT),
)
"""As the gateway seals an event: a MAC for the joiner and one for the analytics sink."""


def worker_headers(topic: str, value: bytes) -> list[tuple[str, bytes]]:
    """The headers its writer sends with ``value``: a worker's seal on a rollout, the
    gateway's MACs on a telemetry event."""
    signer = ROLLOUT_SIGNER if topic == topics.ROLLOUT else EVENT_SIGNER
    return list(signer.headers(value))


def produce_as_its_writer(producer: Producer, topic: str, value: bytes, key: str) -> None:
    """Produce ``value`` to ``topic`` with the headers its writer sends (worker_headers)."""
    producer.produce(
        topic, value, key=key, headers=kafka.kafka_headers(worker_headers(topic, value))
    )


# The operator's signer of API key records (tests/conftest.py generates the pair; servers verify).
KEY_AUTHORITY = KeyAuthority(os.environ["RTRL_API_KEY_SIGNING_KEY"])
