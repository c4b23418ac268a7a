"""The fixtures start real services: keyed records round-trip through Tansu."""

import asyncio
from typing import Any

import pytest
import redis

from rtrl import kafka, topics

pytestmark = pytest.mark.integration


def test_tansu_round_trip_keyed_by_rollout(stack_settings):
    async def produce():
        producer = kafka.AsyncProducer(stack_settings)
        try:
            await asyncio.gather(
                *(
                    producer.send(topics.EDIT, f"v{i}".encode(), key=f"rollout-{i % 5}")
                    for i in range(20)
                )
            )
        finally:
            assert producer.close() == 0

    asyncio.run(produce())
    consumer = kafka.consumer(stack_settings, topics.EDIT, group_id="t")
    # confluent_kafka Messages; Any since key()/value() are typed Optional and these have both.
    records: list[Any] = []
    try:
        for _ in range(50):
            records.extend(m for m in consumer.consume(50, timeout=0.5) if m.error() is None)
            if len(records) >= 20:
                break
    finally:
        consumer.close()
    assert sorted(r.value() for r in records) == sorted(f"v{i}".encode() for i in range(20))
    partitions_by_key: dict[bytes, set[int]] = {}
    for r in records:
        partitions_by_key.setdefault(r.key(), set()).add(r.partition())
    assert all(len(p) == 1 for p in partitions_by_key.values())


def test_consumer_lag_reports_uncommitted_records(stack_settings):
    async def produce():
        producer = kafka.AsyncProducer(stack_settings)
        await asyncio.gather(*(producer.send(topics.REWARD, b"x", key=f"r{i}") for i in range(8)))
        producer.close()

    asyncio.run(produce())
    rows = kafka.consumer_lag(stack_settings, "nobody", (topics.REWARD,))
    assert len(rows) == stack_settings.kafka_partitions
    assert sum(r.lag for r in rows) == 8


def test_redis_is_real(redis_url):
    client = redis.Redis.from_url(redis_url)
    assert client.incr("x") == 1
    assert client.incr("x") == 2


def test_a_stack_plan_never_gives_two_services_one_port():
    """free_port() one call after another can return the port it just released; the plan
    holds every probe socket until all ports are picked."""
    from rtrl.ops.stack import StackConfig
    from rtrl.ops.supervisor import plan

    for _ in range(50):
        ports = [
            port for spec in plan(StackConfig(inference_workers=4)) for port in spec.ports.values()
        ]
        assert len(ports) == len(set(ports)) == 18
