"""The inference workers' rollout signature, for tests that produce rollouts straight to
Kafka as a worker would (tests/conftest.py generates the key pair; the joiner verifies)."""

from __future__ import annotations

import os

from rtrl import signing, topics
from rtrl.api_keys import KeyAuthority

ROLLOUT_SIGNER = signing.Signer(
    os.environ["RTRL_INFERENCE_ROLLOUT_SIGNING_KEY"], signing.Purpose.ROLLOUT
)


def worker_headers(topic: str, value: bytes) -> list[tuple[str, bytes]]:
    """The headers a worker sends with ``value``: a rollout's signature; none for telemetry."""
    return list(ROLLOUT_SIGNER.headers(value)) if topic == topics.ROLLOUT else []


# The operator's signer of API key records (tests/conftest.py generates the pair; servers verify).
KEY_AUTHORITY = KeyAuthority(os.environ["RTRL_API_KEY_SIGNING_KEY"])
