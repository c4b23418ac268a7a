"""The analytics process: the sink thread, the read-only query endpoint, the heartbeat."""

from __future__ import annotations

import asyncio
import logging
import threading

import redis.asyncio as aioredis
from aiohttp import web
from clickhouse_connect.driver.client import Client
from confluent_kafka import Consumer
from opentelemetry import metrics

from rtrl import entrypoint, heartbeat, kafka, otel, topics
from rtrl.analytics import query, schema
from rtrl.analytics.authn import Authenticator
from rtrl.analytics.config import AnalyticsSettings
from rtrl.analytics.sink import Sink
from rtrl.config import StackSettings
from rtrl.http_limits import serve_http
from rtrl.runtime import service_process, until_stopped

log = logging.getLogger("analytics")

SERVICE = "analytics"


def _observe(sink: Sink, group: str) -> None:
    """The sink's counters and its consumer's lag as OpenTelemetry (and so Prometheus) metrics."""
    meter = metrics.get_meter("rtrl.analytics")
    otel.observe(
        meter,
        "rtrl.analytics.consumed",
        "counter",
        lambda: [(sink.consumed, {})],
        unit="{record}",
        description="Records read",
    )
    otel.observe(
        meter,
        "rtrl.analytics.inserted",
        "counter",
        lambda: [(n, {"table": table}) for table, n in sink.inserted.items()],
        unit="{row}",
        description="Rows inserted, per table (a replay after a crash inserts some twice; tables dedup by id)",
    )
    otel.observe(
        meter,
        "rtrl.analytics.refused",
        "counter",
        # Every topic from the start, at 0: a rule's increase() sees the first refusal.
        lambda: [
            (sink.refused.get(topic, 0), {"topic": topic})
            for topic in dict.fromkeys([*topics.ALL, *list(sink.refused)])
        ],
        unit="{record}",
        description="Records kept only as dead letters: their writer did not verify (analytics/authn.py)",
    )
    otel.observe(
        meter,
        "rtrl.analytics.pending",
        "gauge",
        lambda: [(sink.status().pending, {})],
        unit="{row}",
        description="Rows buffered, not yet inserted",
    )
    otel.observe_lag(meter, group, sink.lag.readings)


async def serve(
    stack: StackSettings, settings: AnalyticsSettings, stop: asyncio.Event | None = None
) -> None:
    """Run until SIGTERM/SIGINT (or ``stop`` is set); then insert and commit what is buffered."""
    authenticator = Authenticator.of(settings, stack)
    await asyncio.to_thread(kafka.wait_for_broker, stack)
    await asyncio.to_thread(kafka.ensure_topics, stack)
    writer = query.connect(stack)
    schema.create_tables(writer)
    reader = query.read_only_client(
        stack,
        settings.query_timeout_s,
        settings.query_max_rows,
        settings.query_max_bytes,
        settings.query_clickhouse_url.get_secret_value(),
    )
    tables = query.project_tables(writer)
    consumer = Consumer(kafka.consumer_config(stack, settings.group_id))
    sink = Sink(
        consumer,
        writer,
        authenticator=authenticator,
        batch_size=settings.batch_size,
        flush_interval_s=settings.flush_interval_s,
    )
    consumer.subscribe(list(topics.ALL), on_revoke=sink.on_revoke)

    runner = await _serve_queries(settings, reader, tables)
    redis = aioredis.Redis.from_url(stack.redis_url)
    stopping = threading.Event()
    sink_task = asyncio.create_task(
        asyncio.to_thread(sink.run, stopping, settings.shutdown_drain_s)
    )
    _observe(sink, settings.group_id)
    beats = asyncio.create_task(heartbeat.beat_forever(redis, SERVICE, stack.instance, sink.status))
    log.info(
        "analytics sink on %s, query endpoint %s:%d",
        stack.resolved_clickhouse_url(),
        settings.bind_host,
        settings.query_port,
    )
    try:
        # A failed insert or a lost Redis ends the process; the supervisor restarts it and
        # the sink resumes from the last committed offsets.
        await until_stopped(sink_task, beats, stop=stop)
    finally:
        stopping.set()
        beats.cancel()
        await asyncio.gather(sink_task, beats, return_exceptions=True)
        consumer.close()
        await runner.cleanup()
        await redis.aclose()
        reader.close()
        writer.close()


async def _serve_queries(
    settings: AnalyticsSettings, reader: Client, tables: dict[str, frozenset[str]]
) -> web.AppRunner:
    """The read-only query endpoint, listening; the caller cleans the runner up."""
    token = settings.query_token.get_secret_value()
    runner = await serve_http(
        query.build_query_app(
            reader, tables, token, settings.query_max_rows, settings.query_max_bytes
        ),
        settings.bind_host,
        settings.query_port,
        settings.http_limits(),
        settings.http_context(),
    )
    if not token:
        log.warning(
            "no RTRL_ANALYTICS_QUERY_TOKEN: the query endpoint serves nothing (there is no default token)"
        )
    return runner


def main() -> None:
    settings, stack = entrypoint.parse_settings(
        "python -m rtrl.analytics",
        __doc__,
        AnalyticsSettings,
        StackSettings,
        required=AnalyticsSettings.required_secrets,
    )
    entrypoint.configure_logging()
    service_process()
    otel.configure(SERVICE, stack)
    asyncio.run(serve(stack, settings))
