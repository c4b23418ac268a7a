"""OpenTelemetry set-up shared by every service.

The services only use the OpenTelemetry API (tracers, meters); this installs the
SDK behind it, with the exporter the stack's configuration names. On the embedded
stack spans and metrics go to JSON-lines files under ``<state_dir>/otel/``, one
pair per service instance, so they can be read with ``jq`` or loaded into anything.
"""

from __future__ import annotations

import atexit
from pathlib import Path

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

from rtrl.config import StackSettings


def otel_dir(stack: StackSettings) -> Path:
    return Path(stack.state_dir) / "otel"


def configure(service: str, stack: StackSettings) -> None:
    """Install tracer and meter providers for this process (once, at start-up)."""
    if stack.otel_exporter == "none":
        return
    resource = Resource.create({"service.name": f"rtrl-{service}", "service.instance.id": stack.instance})
    directory = otel_dir(stack)
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"{service}-{stack.instance}"
    spans = open(directory / f"{stem}.spans.jsonl", "a", encoding="utf-8")
    samples = open(directory / f"{stem}.metrics.jsonl", "a", encoding="utf-8")

    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(
        BatchSpanProcessor(ConsoleSpanExporter(out=spans, formatter=lambda span: span.to_json(indent=None) + "\n"))
    )
    reader = PeriodicExportingMetricReader(
        ConsoleMetricExporter(out=samples, formatter=lambda data: data.to_json(indent=None) + "\n"),
        export_interval_millis=stack.otel_metric_interval_s * 1000,
    )
    meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(meter_provider)

    def shutdown() -> None:
        tracer_provider.shutdown()
        meter_provider.shutdown()
        spans.close()
        samples.close()

    atexit.register(shutdown)
