"""The inference workers' rollout signature, for tests that produce rollouts straight to
Kafka as a worker would (conftest.py generates the key pair; the joiner verifies)."""

from __future__ import annotations

import os

from rtrl import signing, topics

ROLLOUT_SIGNER = signing.Signer(os.environ["RTRL_INFERENCE_ROLLOUT_SIGNING_KEY"], signing.Purpose.ROLLOUT)


def worker_headers(topic: str, value: bytes) -> list[tuple[str, bytes]]:
    """The headers a worker sends with ``value``: a rollout's signature; none for telemetry."""
    return list(ROLLOUT_SIGNER.headers(value)) if topic == topics.ROLLOUT else []
