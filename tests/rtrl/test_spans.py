"""rtrl/spans.py: an instant span is the span the SDK would have made, sampled as the SDK
samples (rtrl.otel's ParentBased(TraceIdRatioBased)), and nothing when tracing is off."""

from __future__ import annotations

import json

import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from rtrl import otel, spans

SAMPLED_PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
UNSAMPLED_PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
ATTRIBUTES: dict[str, str | float] = {
    "messaging.system": "kafka",
    "rtrl.rollout_id": "r-1",
    "rtrl.reward": 0.25,
}


class Tracing:
    """A tracer provider as rtrl.otel installs one, with instant spans recording into it."""

    def __init__(self, sample_ratio: float) -> None:
        self.exported = InMemorySpanExporter()
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": "rtrl-test"}),
            sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
        )
        processor = SimpleSpanProcessor(self.exported)
        self.provider.add_span_processor(processor)
        spans.install(processor, self.provider.resource, self.provider.sampler)

    def sdk_span(self, parent: str) -> str:
        span = self.provider.get_tracer("rtrl.test").start_span(
            "reward settle",
            context=otel.parent(parent),
            kind=trace.SpanKind.PRODUCER,
            attributes=ATTRIBUTES,
        )
        span.end()
        return otel.traceparent_of(span)


@pytest.fixture
def tracing():
    yield Tracing(1.0)
    spans.uninstall()


def _instant_span(parent: str) -> str:
    return spans.InstantSpans("rtrl.test").record(
        "reward settle", parent, trace.SpanKind.PRODUCER, ATTRIBUTES
    )


def _traceparent(span: ReadableSpan) -> str:
    context = span.context
    assert context is not None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def _exported_line(span: ReadableSpan) -> dict:
    """What the file exporter writes, less what differs between any two spans."""
    line = json.loads(otel.span_line(span))
    del line["context"]["span_id"], line["start_time"], line["end_time"]
    return line


def test_an_instant_span_is_the_sdks_span(tracing):
    sdk_traceparent = tracing.sdk_span(SAMPLED_PARENT)
    instant_traceparent = _instant_span(SAMPLED_PARENT)

    sdk, instant = tracing.exported.get_finished_spans()
    assert _exported_line(instant) == _exported_line(sdk)
    assert instant.instrumentation_scope == sdk.instrumentation_scope
    assert instant.parent is not None and instant.parent.span_id == 0xB7AD6B7169203331
    assert instant.start_time == instant.end_time
    assert (sdk_traceparent, instant_traceparent) == (_traceparent(sdk), _traceparent(instant))
    assert instant_traceparent != sdk_traceparent


def test_a_span_without_a_parent_starts_a_trace(tracing):
    traceparent = _instant_span("not a traceparent")
    (span,) = tracing.exported.get_finished_spans()
    assert span.parent is None
    assert traceparent == _traceparent(span) and traceparent.endswith("-03")


@pytest.mark.parametrize(
    "parent, ratio",
    [(UNSAMPLED_PARENT, 1.0), ("", 0.0)],
    ids=["parent not sampled", "no parent, sample ratio 0"],
)
def test_what_the_sampler_drops_is_not_recorded(parent, ratio):
    tracing = Tracing(ratio)
    try:
        traceparent = _instant_span(parent)
        sdk_traceparent = tracing.sdk_span(parent)
    finally:
        spans.uninstall()
    assert tracing.exported.get_finished_spans() == ()
    # Not sampled; a new trace's id is flagged as drawn at random, as the SDK flags it.
    flags = "00" if parent else "02"
    assert (traceparent[-2:], sdk_traceparent[-2:]) == (flags, flags)
    if parent:
        trace_id, span_id = traceparent.split("-")[1:3]
        assert (trace_id, span_id != "b7ad6b7169203331") == (parent.split("-")[1], True)


def test_without_tracing_the_parents_context_passes_on():
    spans.uninstall()
    assert _instant_span(SAMPLED_PARENT) == SAMPLED_PARENT
    assert _instant_span("") == ""
    assert _instant_span("00-xyz-b7ad6b7169203331-01") == ""
