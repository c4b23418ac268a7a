"""What becomes of a served completion, and how a recorded one is written.

Every completion is served; what the trainer may learn from is the server's decision,
one of three, each with its reason in its type:
  Record            its RolloutRecord is published on the rollout topic
  Private           privacy mode, or a user registered as private: nothing is written
  KeptFromTraining  served, not recorded, and the caller is told why (``not_recorded``):
                    an arm the caller chose (a caller that picks one would also pick what
                    trains it), sampling outside the trained band, or a record whose
                    metadata alone is too large for the broker to carry with the reward
                    built on it (a long record's bulk travels out of band)
An agent's turn (InTrajectory) is decided with its trajectory's link, when that ends.

Produced by the completions handler (inference/completions.py) once the completion is
generated; consumed by its publish and answer steps and by its request counters.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import redis.asyncio as aioredis
from opentelemetry import trace

from rtrl import bulk, kafka, otel, signing, topics
from rtrl.api_keys import PRIVATE_USERS, SERVED_PREFIX, ApiKey
from rtrl.inference.api import RequestBody
from rtrl.inference.config import InferenceSettings
from rtrl.v1 import rollout_pb2

log = logging.getLogger("inference")
_tracer = trace.get_tracer("rtrl.inference")


@dataclass(frozen=True)
class Record:
    """Recorded: the trainer learns from it."""

    value: bytes
    """The serialized RolloutRecord, as published."""


@dataclass(frozen=True)
class Private:
    """Privacy mode, or a user registered as private: nothing is written anywhere."""


@dataclass(frozen=True)
class KeptFromTraining:
    """Served but not recorded; the product need not report telemetry about it."""

    reason: str
    """Why, as the answer's ``not_recorded`` tells the caller."""


@dataclass(frozen=True)
class InTrajectory:
    """A turn of an agent's trajectory: recorded with its link when that ends
    (inference/sessions.py), by the same three rules."""


Recording = Record | Private | KeptFromTraining | InTrajectory


async def is_private(redis: aioredis.Redis, body: RequestBody, user_id: str) -> bool:
    """One privacy policy at every door: the request's flag, or its end user registered as
    private (the same set the ingest gateway reads)."""
    return body.privacy_mode or bool(await redis.sismember(PRIVATE_USERS, user_id))


def kept_from_training(
    settings: InferenceSettings, body: RequestBody, temperature: float, top_p: float
) -> KeptFromTraining | None:
    """Why a request's completion will not be recorded, known before it is generated
    (None: nothing yet keeps it). The arm is the server's to assign, and sampling must be
    the policy's own, within the trained band."""
    s = settings
    if body.arm is not None:
        return KeptFromTraining("the caller chose the arm")
    if not s.trained_temperature_min <= temperature <= s.trained_temperature_max:
        return KeptFromTraining(
            f"temperature {temperature:g} is outside the trained band "
            f"[{s.trained_temperature_min:g}, {s.trained_temperature_max:g}]"
        )
    if top_p < s.trained_top_p_min:
        return KeptFromTraining(
            f"top_p {top_p:g} is below the trained band's {s.trained_top_p_min:g}"
        )
    return None


class RolloutPublisher:
    """Writes recorded rollouts: a long one's bulk out of band first (rtrl/bulk.py), then
    the record, sealed for its readers (the workers' signature, the joiner's MAC), traced as
    a child of the serving span, and acked by the broker before the request is answered (so
    a product event never refers to an unknown rollout)."""

    def __init__(
        self,
        producer: kafka.AsyncProducer,
        signer: signing.Seal,
        redis: aioredis.Redis,
        store: bulk.BulkStore,
        *,
        max_record_bytes: int,
        inline_bytes: int,
        served_ttl_s: int,
    ) -> None:
        self.producer = producer
        self._signer = signer
        self._redis = redis
        self._store = store
        self._max_rollout_bytes = kafka.max_rollout_bytes(max_record_bytes)
        self._inline_bytes = inline_bytes
        self._served_ttl_s = served_ttl_s
        self.out_of_band = 0
        """Records written with their bulk in the store."""

    async def seal(self, record: rollout_pb2.RolloutRecord) -> Record | KeptFromTraining:
        """``record`` as it is written: whole up to the inline limit, else its bulk stored
        first and the record naming it. Kept from training only when the bulk cannot be
        stored, or what travels is still over the broker's limit (metadata alone: a
        prompt group id, a context key), with room for the reward that carries it."""
        limit = self._max_rollout_bytes
        blob = b""
        if record.ByteSize() > min(self._inline_bytes, limit):
            slim, blob = bulk.split(record)
            value = slim.SerializeToString()
        else:
            value = record.SerializeToString()
        if len(value) > limit:
            log.warning(
                "rollout %s served but not recorded: %d bytes, over %d",
                record.rollout_id,
                len(value),
                limit,
            )
            return KeptFromTraining(
                f"its rollout record is {len(value):,} bytes without its bulk, over the "
                f"{limit:,} that leave room for the reward carrying it (RTRL_KAFKA_MAX_RECORD_BYTES)"
            )
        if blob:
            try:
                await asyncio.to_thread(self._store.put, blob)
            except OSError as exc:
                log.exception("rollout %s: its bulk was not stored", record.rollout_id)
                return KeptFromTraining(f"its bulk of {len(blob):,} bytes was not stored: {exc}")
            self.out_of_band += 1
        return Record(value)

    async def publish(
        self, rollout_id: str, record: Record, key: ApiKey | None, traceparent: str
    ) -> None:
        """Remember which client was served the rollout, then publish it and wait for the ack."""
        await self.mark_served(rollout_id, key)
        attributes = otel.kafka_attributes("publish", topics.ROLLOUT, key=rollout_id)
        with _tracer.start_as_current_span(
            f"publish {topics.ROLLOUT}", kind=trace.SpanKind.PRODUCER, attributes=attributes
        ) as producing:
            headers = [
                *kafka.traceparent_headers(otel.traceparent_of(producing) or traceparent),
                *self._signer.headers(record.value),
            ]
            await self.producer.send(topics.ROLLOUT, record.value, key=rollout_id, headers=headers)

    async def mark_served(self, rollout_id: str, key: ApiKey | None) -> None:
        """Which client was served the rollout: before its answer, as the client's
        telemetry about it may arrive right after (an agent's: at its first turn)."""
        if key is not None:
            await self._redis.set(SERVED_PREFIX + rollout_id, key.client_id, ex=self._served_ttl_s)
