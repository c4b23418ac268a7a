"""OpenTelemetry set-up shared by every service, and the trace-context helpers.

The services only use the OpenTelemetry API (tracers, meters); ``configure`` installs
the SDK behind it with the exporters the stack's configuration names:

- ``RTRL_OTEL_EXPORTER=file`` (the embedded stack): spans and metrics go to JSON-lines
  files under ``<state_dir>/otel/``, one pair per service instance, readable with
  ``jq`` or loadable into anything;
- ``otlp`` (production): OTLP/gRPC to the collector at ``RTRL_OTLP_ENDPOINT``;
- ``RTRL_METRICS_PORT`` (any exporter): a Prometheus ``/metrics`` endpoint, read at
  scrape time. The OpenTelemetry names map to Prometheus conventions there:
  ``rtrl.ingest.events`` with unit ``{event}`` is ``rtrl_ingest_events_total``,
  a duration in ``s`` gets ``_seconds``.

One rollout is one trace. Its serving span (inference) is the root; the client's
events (ingest) and the reward that settles it (reward_stream) are its children,
joined by the W3C ``traceparent`` each record carries. A training step has many
rollouts, so its span starts a trace of its own with a link to each reward; the
weight_sync commit of the version it shipped and every worker's apply span follow
it as children, through the manifest's ``traceparent``.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, cast

from aiohttp import web
from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricExporter,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from rtrl import spans
from rtrl.config import StackSettings
from rtrl.rotation import RotatingText

log = logging.getLogger(__name__)

MAX_LINKS = 128
"""Links per span, at most (a training step of 1,000 rollouts links the first 128)."""


def otel_dir(stack: StackSettings) -> Path:
    return Path(stack.state_dir) / "otel"


def configure(service: str, stack: StackSettings) -> None:
    """Install tracer and meter providers for this process (once, at start-up), and
    serve the Prometheus endpoint if ``stack.metrics_port`` names one."""
    resource = Resource.create(
        {"service.name": f"rtrl-{service}", "service.instance.id": stack.instance}
    )
    exporters = _exporters(service, stack)
    readers: list[MetricReader] = []
    if exporters is not None:
        readers.append(
            PeriodicExportingMetricReader(
                exporters.metrics, export_interval_millis=stack.otel_metric_interval_s * 1000
            )
        )
    if stack.metrics_port:
        readers.append(_serve_prometheus(stack))
    if exporters is None and not readers:
        return
    _install(resource, stack.otel_trace_sample_ratio, exporters, readers)


@dataclasses.dataclass(frozen=True)
class _Exporters:
    """Where this process's spans and metric samples go (``RTRL_OTEL_EXPORTER``)."""

    spans: SpanExporter
    metrics: MetricExporter
    closing: tuple[Callable[[], None], ...] = ()
    """Closed at exit, after the providers have flushed into them."""


def _exporters(service: str, stack: StackSettings) -> _Exporters | None:
    """The exporters ``stack.otel_exporter`` names; None for ``none``."""
    if stack.otel_exporter == "file":
        return _file_exporters(
            otel_dir(stack), f"{service}-{stack.instance}", stack.otel_file_max_bytes
        )
    if stack.otel_exporter == "otlp":
        return _otlp_exporters(stack.otlp_endpoint)
    return None


def _file_exporters(directory: Path, stem: str, max_bytes: int) -> _Exporters:
    """JSON lines appended to ``<stem>.spans.jsonl`` and ``<stem>.metrics.jsonl``, each
    rotated past ``max_bytes`` (rtrl/rotation.py)."""
    directory.mkdir(parents=True, exist_ok=True)
    # The console exporters only write and flush: a RotatingText is all of IO they use.
    spans = cast(IO[str], RotatingText(directory / f"{stem}.spans.jsonl", max_bytes))
    samples = cast(IO[str], RotatingText(directory / f"{stem}.metrics.jsonl", max_bytes))
    return _Exporters(
        spans=ConsoleSpanExporter(out=spans, formatter=span_line),
        metrics=ConsoleMetricExporter(
            out=samples, formatter=lambda data: data.to_json(indent=None) + "\n"
        ),
        closing=(spans.close, samples.close),
    )


def _otlp_exporters(endpoint: str) -> _Exporters:
    """OTLP/gRPC to the collector at ``endpoint`` (plaintext when it says ``http://``)."""
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    insecure = endpoint.startswith("http://")
    return _Exporters(
        spans=OTLPSpanExporter(endpoint=endpoint, insecure=insecure),
        metrics=OTLPMetricExporter(endpoint=endpoint, insecure=insecure),
    )


def _install(
    resource: Resource,
    sample_ratio: float,
    exporters: _Exporters | None,
    readers: list[MetricReader],
) -> None:
    """Set the global tracer and meter providers, and shut them down at exit."""
    sampler = ParentBased(TraceIdRatioBased(sample_ratio))
    tracer_provider = TracerProvider(resource=resource, sampler=sampler)
    processor = BatchSpanProcessor(exporters.spans) if exporters is not None else None
    if processor is not None:
        tracer_provider.add_span_processor(processor)
    spans.install(processor, tracer_provider.resource, sampler)
    meter_provider = MeterProvider(resource=resource, metric_readers=readers)
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(meter_provider)
    closing = exporters.closing if exporters is not None else ()

    def shutdown() -> None:
        spans.uninstall()
        tracer_provider.shutdown()
        meter_provider.shutdown()
        for close in closing:
            close()

    atexit.register(shutdown)


def span_line(span: ReadableSpan) -> str:
    """One span as a line of JSON for the file exporter: what ReadableSpan.to_json holds
    that a reader follows traces by (ids as 0x-prefixed hex, times in ns since the
    epoch), cheaper than to_json, which the joiner pays per reward: the resource, the same
    for every span of a process, is encoded once."""
    context = span.context
    parent = span.parent
    links = span.links
    head = _dumps(
        {
            "name": span.name,
            "context": {
                "trace_id": f"0x{context.trace_id:032x}",
                "span_id": f"0x{context.span_id:016x}",
            },
            "kind": str(span.kind),
            "parent_id": f"0x{parent.span_id:016x}" if parent is not None else None,
            "start_time": span.start_time,
            "end_time": span.end_time,
            "status": span.status.status_code.name,
            "attributes": dict(span.attributes or {}),
            "links": [
                {
                    "context": {
                        "trace_id": f"0x{link.context.trace_id:032x}",
                        "span_id": f"0x{link.context.span_id:016x}",
                    }
                }
                for link in links
            ]
            if links
            else [],
        }
    )
    return f'{head[:-1]},"resource":{_resource_json(span.resource)}}}\n'


_dumps = json.JSONEncoder(separators=(",", ":")).encode


_RESOURCES: dict[int, tuple[Resource, str]] = {}
"""id -> (resource, its JSON): by identity, as Resource's own hash encodes it to JSON."""


def _resource_json(resource: Resource) -> str:
    """A resource's part of span_line, encoded once (a process has one resource)."""
    known = _RESOURCES.get(id(resource))
    if known is None or known[0] is not resource:
        known = _RESOURCES[id(resource)] = (
            resource,
            _dumps({"attributes": dict(resource.attributes)}),
        )
    return known[1]


def _serve_prometheus(stack: StackSettings) -> MetricReader:
    """The ``/metrics`` endpoint: an rtrl.http_limits listener on a thread of its own (the
    process's main thread may run no asyncio loop), so it has the same deadlines as the
    services' APIs; prometheus_client's own server has none."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader

    from rtrl import http_limits, tls

    host, port = stack.metrics_bind_host, stack.metrics_port
    cert_file, key_file = stack.metrics_tls_cert_file, stack.metrics_tls_key_file
    context = tls.server_context(cert_file, key_file) if cert_file and key_file else None
    # A scrape is one small GET: one deadline for the handshake, the headers, a body and idling.
    timeout_s = stack.metrics_client_timeout_s
    limits = http_limits.HTTPLimits(timeout_s, timeout_s, timeout_s)
    app = web.Application()
    app.router.add_get("/metrics", _metrics_page)
    try:
        http_limits.serve_http_in_thread(app, host, port, limits, context)
    except OSError as exc:
        raise RuntimeError(
            f"cannot serve Prometheus metrics on {host}:{port} (RTRL_METRICS_PORT): {exc}"
        ) from exc
    log.info("Prometheus metrics on %s://%s:%d/metrics", "https" if context else "http", host, port)
    # No "target_info" series and no otel_scope_* labels: the names already say which
    # service a series belongs to, and Prometheus's own job/instance labels which process.
    return PrometheusMetricReader(disable_target_info=True, scope_info_enabled=False)


async def _metrics_page(request: web.Request) -> web.Response:
    """The page prometheus_client's own server would answer: the text or the OpenMetrics
    format, as the scraper's Accept header asks, compressed if it accepts that."""
    from prometheus_client import REGISTRY
    from prometheus_client.exposition import choose_encoder

    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    response = web.Response(body=encoder(REGISTRY), headers={"Content-Type": content_type})
    response.enable_compression()
    return response


# -- trace context -----------------------------------------------------------------


def parent(traceparent: str) -> otel_context.Context | None:
    """The context to start a child span of a W3C ``traceparent`` received from another
    process; None when it is empty or malformed (the span then starts a new trace)."""
    span_context = spans.span_context(traceparent)
    return (
        trace.set_span_in_context(trace.NonRecordingSpan(span_context))
        if span_context is not None
        else None
    )


def traceparent_of(span: trace.Span) -> str:
    """The W3C ``traceparent`` of ``span`` ("" for a non-recording one)."""
    span_context = span.get_span_context()
    if not span_context.is_valid:
        return ""
    return f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-{int(span_context.trace_flags):02x}"


def links(traceparents: Iterable[str]) -> list[trace.Link]:
    """Span links to the spans these traceparents name (at most MAX_LINKS; empty and
    malformed ones skipped)."""
    out: list[trace.Link] = []
    for traceparent in traceparents:
        span_context = spans.span_context(traceparent)
        if span_context is not None:
            out.append(trace.Link(span_context))
            if len(out) == MAX_LINKS:
                break
    return out


def kafka_attributes(
    operation: str,
    topic: str,
    *,
    key: str | None = None,
    partition: int | None = None,
    offset: int | None = None,
) -> dict:
    """Messaging semantic-convention attributes of a span that sends or processes a Kafka record."""
    attributes: dict = {
        "messaging.system": "kafka",
        "messaging.operation.type": operation,
        "messaging.destination.name": topic,
    }
    if key is not None:
        attributes["messaging.kafka.message.key"] = key
    if partition is not None:
        attributes["messaging.destination.partition.id"] = str(partition)
    if offset is not None:
        attributes["messaging.kafka.offset"] = offset
    return attributes


# -- metrics read from a service's own counters ------------------------------------

Reading = Callable[[], Iterable[tuple[float, dict]]]


def observe(
    meter: Meter, name: str, kind: str, read: Reading, *, unit: str = "", description: str = ""
) -> None:
    """An asynchronous instrument whose value is read from the service's own counters
    when metrics are collected, so the hot path pays nothing for it. ``kind`` is
    ``counter`` (monotonic) or ``gauge``; ``read`` returns (value, attributes) pairs."""

    def callback(options: CallbackOptions) -> Iterable[Observation]:
        try:
            return [Observation(value, attributes) for value, attributes in read()]
        except Exception:  # a reading must never take down the exporter
            log.exception("reading metric %s failed", name)
            return []

    create = {"counter": meter.create_observable_counter, "gauge": meter.create_observable_gauge}[
        kind
    ]
    create(name, callbacks=[callback], unit=unit, description=description)


def observe_lag(
    meter: Meter, group: str, read: Callable[[], Iterable[tuple[float, str, int]]]
) -> None:
    """``rtrl.consumer.lag`` of one consumer group: ``read`` gives (records behind,
    topic, partition) per partition the process reads (``PositionLag.readings`` for a
    confluent-kafka Consumer). ``read`` runs on the scrape's thread: it must return
    values the service already holds, never ask Kafka."""
    observe(
        meter,
        "rtrl.consumer.lag",
        "gauge",
        lambda: [
            (lag, {"group": group, "topic": topic, "partition": str(partition)})
            for lag, topic, partition in read()
        ],
        unit="{record}",
        description="Records behind the partition's high watermark",
    )


class PositionLag:
    """Consumer lag of a confluent-kafka Consumer, computed by the thread that polls it
    and read by the metrics scrape.

    librdkafka serializes the calls on one Consumer handle: a scrape thread asking it for
    ``position()`` waits behind the poll thread's ``consume(timeout=…)``, for as long as
    the poll loop runs, so the scrape (and the exporter behind it) would hang. The poll
    thread calls ``refresh`` between polls; the scrape only reads the last readings.
    """

    def __init__(self, min_interval_s: float = 1.0) -> None:
        self.min_interval_s = min_interval_s
        self._readings: tuple[tuple[float, str, int], ...] = ()
        self._refreshed_at = float("-inf")

    def refresh(self, consumer, now: float) -> None:
        """On the polling thread: position against the cached high watermark, no broker
        round trip, at most once per ``min_interval_s`` of ``now`` (monotonic seconds)."""
        if now - self._refreshed_at < self.min_interval_s:
            return
        self._refreshed_at = now
        readings = []
        try:
            for tp in consumer.position(consumer.assignment()):
                if tp.offset < 0:
                    continue
                _, high = consumer.get_watermark_offsets(tp, cached=True)
                if high is not None and high >= 0:
                    readings.append((float(max(0, high - tp.offset)), tp.topic, tp.partition))
        except RuntimeError:  # closed (shutting down): nothing to report
            readings = []
        self._readings = tuple(readings)  # replaced whole: the scrape reads it unlocked

    def readings(self) -> tuple[tuple[float, str, int], ...]:
        return self._readings
