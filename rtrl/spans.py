"""W3C trace context from other processes, and spans of no duration recorded whole.

A hot path that makes one span per record pays for the SDK's general span: the joiner
gives every reward a ``reward settle`` span, a child of its rollout's serving span, so the
rollout's trace shows where its reward settled and the training step can link to it.
Through ``Tracer.start_span`` and ``end`` that span cost ~20 us of the joiner's one busy
core per reward (a mutable span with its own lock, every attribute validated, the sampler
asked through a context), a tenth of the worker's throughput in `rtrl bench join`.
``InstantSpans.record`` makes the finished ``ReadableSpan`` the exporter receives
directly and hands it to the batch processor rtrl.otel installed, in ~8 us: the same
span as the SDK's (tests/rtrl/test_spans.py compares them), on the same exporter.

The tracer provider's sampler decides, as it does for the SDK's spans (rtrl.otel installs
ParentBased(TraceIdRatioBased): a child of a sampled remote parent is recorded).
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.sampling import Sampler
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace.status import Status, StatusCode
from opentelemetry.util.types import AttributeValue

_UNSET = Status(StatusCode.UNSET)


def span_context(traceparent: str) -> trace.SpanContext | None:
    """The remote span a W3C ``traceparent`` names; None when it is empty or malformed."""
    parts = traceparent.split("-")
    if len(parts) != 4 or len(parts[1]) != 32 or len(parts[2]) != 16 or len(parts[3]) != 2:
        return None
    try:
        context = trace.SpanContext(
            int(parts[1], 16),
            int(parts[2], 16),
            is_remote=True,
            trace_flags=trace.TraceFlags(int(parts[3], 16)),
        )
    except ValueError:
        return None
    return context if context.is_valid else None


# Made by rtrl.otel when it installs the process's tracer provider; read by InstantSpans.
@dataclass(frozen=True)
class _Recording:
    """Where this process's spans go, and how they are sampled."""

    processor: SpanProcessor | None
    """None when spans are made but exported nowhere (metrics only)."""
    resource: Resource
    sampler: Sampler


_recording: _Recording | None = None


def install(processor: SpanProcessor | None, resource: Resource, sampler: Sampler) -> None:
    """Record instant spans like the tracer provider just installed (rtrl.otel._install)."""
    global _recording
    _recording = _Recording(processor, resource, sampler)


def uninstall() -> None:
    """Back to no tracing: spans are not recorded, a parent's context is passed on."""
    global _recording
    _recording = None


class InstantSpans:
    """One instrumentation scope's spans that start and end at once."""

    def __init__(self, scope: str) -> None:
        self._scope = InstrumentationScope(scope, "")  # what Tracer names an unversioned scope

    def record(
        self,
        name: str,
        parent: str,
        kind: trace.SpanKind,
        attributes: Mapping[str, AttributeValue],
    ) -> str:
        """Record span ``name``, a child of the span W3C ``parent`` names (a new trace when
        it names none), and return the span's traceparent, as ``traceparent_of`` would give
        it for the SDK's span: the parent's own when tracing is off, "" when there is
        neither. ``attributes`` go out as given: str, bool, int or float values only."""
        recording = _recording
        parent_context = span_context(parent)
        if recording is None:
            return parent if parent_context is not None else ""
        if parent_context is not None:
            trace_id = parent_context.trace_id
            context = trace.set_span_in_context(trace.NonRecordingSpan(parent_context))
            # The SDK's flag for a trace id drawn at random passes on from the parent.
            flags = parent_context.trace_flags & trace.TraceFlags.RANDOM_TRACE_ID
        else:
            trace_id, context = random.getrandbits(128) or 1, None
            flags = trace.TraceFlags.RANDOM_TRACE_ID
        sampling = recording.sampler.should_sample(context, trace_id, name, kind, attributes)
        span_id = random.getrandbits(64) or 1
        if not sampling.decision.is_sampled():
            return f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"
        flags |= trace.TraceFlags.SAMPLED
        span = trace.SpanContext(
            trace_id,
            span_id,
            is_remote=False,
            trace_flags=trace.TraceFlags(flags),
            trace_state=sampling.trace_state,
        )
        if recording.processor is not None:
            recorded: dict[str, Any] = dict(attributes)
            if sampling.attributes:
                recorded.update(sampling.attributes)
            now = time.time_ns()
            recording.processor.on_end(
                ReadableSpan(
                    name,
                    context=span,
                    parent=parent_context,
                    resource=recording.resource,
                    attributes=recorded,
                    kind=kind,
                    status=_UNSET,
                    start_time=now,
                    end_time=now,
                    instrumentation_scope=self._scope,
                )
            )
        return f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"
