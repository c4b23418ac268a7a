"""A gateway killed between the broker's ack and marking its events done must not
let a resend write them twice: the in-flight records it leaves make resends RETRY,
and the recovery sweep settles them by reading the topic (ingest/recovery.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis

from rtrl import kafka
from rtrl.ingest.gateway import ACCEPTED, DUPLICATE, INFLIGHT, RETRY, Gateway, dedup_key
from rtrl.ingest.recovery import Sweep, sweep
from support.ingest import read_topics, shown
from support.signing import EVENT_SIGNER

pytestmark = pytest.mark.integration


class Killed(Exception):
    """Stands in for kill -9: nothing after it runs."""


class DiesAfterTheBroker:
    """Produces for real (the broker acks), then the process 'dies' before Redis hears of it."""

    def __init__(self, producer: kafka.AsyncProducer) -> None:
        self.producer = producer

    async def send_batch(self, records):
        errors = await self.producer.send_batch(records)
        assert errors == [None] * len(records)
        raise Killed


class DiesBeforeTheBroker:
    async def send_batch(self, records):
        raise Killed


@pytest.mark.guarantee(1)
def test_events_abandoned_mid_produce_are_settled_from_the_topic(
    stack_settings, collect_kafka_clients
):
    landed = [shown(f"landed-{i}") for i in range(30)]
    lost = [shown(f"lost-{i}") for i in range(20)]
    kwargs: dict[str, Any] = dict(
        dedup_ttl_s=3600, claim_ttl_s=30, max_inflight=1000, signer=EVENT_SIGNER
    )

    async def scenario():
        client = aioredis.Redis.from_url(stack_settings.redis_url)
        producer = kafka.AsyncProducer(stack_settings)
        try:
            for dying, events in (
                (DiesAfterTheBroker(producer), landed),
                (DiesBeforeTheBroker(), lost),
            ):
                with pytest.raises(Killed):
                    await Gateway(dying, client, **kwargs).publish(events)
            assert await client.hlen(INFLIGHT) == 50

            gateway = Gateway(producer, client, **kwargs)
            # Even once the claims expire, the in-flight records hold resends back.
            await client.delete(*(dedup_key(e.event_id) for e in landed + lost))
            results = await gateway.publish(landed + lost)
            assert {r.status for r in results} == {RETRY}

            # A sweep only takes records older than the claim TTL: these are not, yet.
            assert await asyncio.to_thread(
                sweep,
                stack_settings,
                stack_settings.redis_url,
                older_than_ms=30_000,
                dedup_ttl_s=3600,
            ) == Sweep(0, 0)
            settled = await asyncio.to_thread(
                sweep, stack_settings, stack_settings.redis_url, older_than_ms=0, dedup_ttl_s=3600
            )
            assert (settled.landed, settled.released) == (30, 20)
            assert await client.hlen(INFLIGHT) == 0

            results = await gateway.publish(landed + lost)
            assert [r.status for r in results] == [DUPLICATE] * 30 + [ACCEPTED] * 20
            assert await client.hlen(INFLIGHT) == 0
        finally:
            await asyncio.to_thread(producer.close)
            await client.aclose()

    asyncio.run(scenario())
    on_topics = [
        event.event_id for records in read_topics(stack_settings).values() for _, event in records
    ]
    assert sorted(on_topics) == sorted(e.event_id for e in landed + lost), "each event exactly once"
