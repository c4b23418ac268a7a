"""OpenTelemetry plumbing: trace-context helpers, OTLP export to a collector, the
Prometheus endpoint, and the trace context carried by manifests and rewards.

The OTLP test runs the real weight_sync process with ``RTRL_OTEL_EXPORTER=otlp``
against a collector stand-in that speaks the real OTLP/gRPC services (the
opentelemetry-proto definitions an OpenTelemetry Collector implements).
"""

from __future__ import annotations

import sys
import threading
import urllib.request
from concurrent import futures

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.collector.trace.v1 import (
    trace_service_pb2,
    trace_service_pb2_grpc,
)

from rtrl import otel, procs
from rtrl.weight_sync.client import Publisher
from support import wait
from support.weight_sync import (
    ARM,
    MANIFEST_KEY,
    MANIFEST_PUBLIC_KEYS,
    publish_versions,
)

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_parent_continues_a_traceparent_and_rejects_garbage():
    context = otel.parent(TRACEPARENT)
    span_context = trace.get_current_span(context).get_span_context()
    assert (f"{span_context.trace_id:032x}", f"{span_context.span_id:016x}") == (
        "0af7651916cd43dd8448eb211c80319c",
        "b7ad6b7169203331",
    )
    assert span_context.is_remote
    for garbage in (
        "",
        "00-xyz-b7ad6b7169203331-01",
        "00-" + "0" * 32 + "-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad",
        "nonsense",
    ):
        assert otel.parent(garbage) is None, garbage


def test_links_skip_malformed_and_stop_at_the_limit():
    good = [f"00-{i + 1:032x}-{i + 1:016x}-01" for i in range(otel.MAX_LINKS + 5)]
    links = otel.links(["", "bad", *good])
    assert len(links) == otel.MAX_LINKS
    assert links[0].context.trace_id == 1 and links[-1].context.span_id == otel.MAX_LINKS


def test_traceparent_round_trips_through_a_recorded_span(otel_memory):
    with trace.get_tracer("test").start_as_current_span(
        "child", context=otel.parent(TRACEPARENT)
    ) as span:
        traceparent = otel.traceparent_of(span)
    trace_id, span_id = traceparent.split("-")[1:3]
    assert trace_id == "0af7651916cd43dd8448eb211c80319c" and span_id != "b7ad6b7169203331"
    assert otel.traceparent_of(trace.INVALID_SPAN) == ""


class _Collector(
    trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer
):
    """What an OpenTelemetry Collector's OTLP/gRPC receiver accepts, kept in memory."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict, object]] = []
        self.metric_names: set[str] = set()
        self.changed = threading.Condition()
        self.endpoint = ""  # set by the fixture once the server listens

    def Export(self, request, context):
        with self.changed:
            if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
                for resource_spans in request.resource_spans:
                    resource = {
                        a.key: a.value.string_value for a in resource_spans.resource.attributes
                    }
                    self.spans += [
                        (resource, span)
                        for scope in resource_spans.scope_spans
                        for span in scope.spans
                    ]
                self.changed.notify_all()
                return trace_service_pb2.ExportTraceServiceResponse()
            for resource_metrics in request.resource_metrics:
                self.metric_names |= {
                    m.name for scope in resource_metrics.scope_metrics for m in scope.metrics
                }
            self.changed.notify_all()
            return metrics_service_pb2.ExportMetricsServiceResponse()

    def wait(self, condition, timeout_s: float = 30.0) -> bool:
        with self.changed:
            return self.changed.wait_for(condition, timeout_s)


@pytest.fixture
def collector():
    servicer = _Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.endpoint = f"http://127.0.0.1:{port}"
    yield servicer
    server.stop(0)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_weight_sync_exports_over_otlp_and_serves_prometheus(
    collector, otel_memory, stack, tmp_path, repo_root, policy_weights
):
    """The real weight_sync process: its commit span continues the publisher's trace
    and reaches the collector over OTLP with the service's resource; its metrics reach
    the collector too, and its /metrics page serves them by Prometheus names."""
    port, metrics_port = procs.free_port(), procs.free_port()
    env = {
        "RTRL_REDIS_URL": stack.redis_url,
        "RTRL_STATE_DIR": str(stack.state_dir),
        "RTRL_WEIGHT_SYNC_PORT": str(port),
        "RTRL_INSTANCE": "otlp",
        "RTRL_OTEL_EXPORTER": "otlp",
        "RTRL_OTLP_ENDPOINT": collector.endpoint,
        "RTRL_OTEL_METRIC_INTERVAL_S": "0.5",
        "RTRL_METRICS_PORT": str(metrics_port),
        "PYTHONPATH": str(repo_root),
    }
    proc = procs.spawn(
        "weight_sync",
        [sys.executable, "-m", "rtrl.weight_sync"],
        tmp_path / "weight_sync.log",
        env=env,
        port=port,
    )
    publisher = Publisher(
        f"127.0.0.1:{port}",
        stack.weight_sync_token.get_secret_value(),
        ARM,
        signing_key=MANIFEST_KEY,
    )
    try:
        procs.wait_for_port(port)
        with trace.get_tracer("test").start_as_current_span("trainer.step") as step:
            publish_versions(publisher, policy_weights, 2)
        commits = lambda: [(r, s) for r, s in collector.spans if s.name == "weights commit"]
        assert collector.wait(lambda: len(commits()) == 2), (
            tmp_path / "weight_sync.log"
        ).read_text()[-3000:]
        for resource, span in commits():
            assert (
                resource["service.name"] == "rtrl-weight_sync"
                and resource["service.instance.id"] == "otlp"
            )
            assert span.kind == span.SPAN_KIND_SERVER
            assert span.trace_id == step.get_span_context().trace_id.to_bytes(16, "big")
        versions = sorted(
            next(a.value.int_value for a in s.attributes if a.key == "rtrl.policy.version")
            for _, s in commits()
        )
        assert versions == [0, 1]
        assert collector.wait(
            lambda: (
                {"rtrl.weight_sync.versions_published", "rtrl.weight_sync.sent"}
                <= collector.metric_names
            )
        )

        with urllib.request.urlopen(
            f"http://127.0.0.1:{metrics_port}/metrics", timeout=10
        ) as response:
            page = response.read().decode()
        assert "rtrl_weight_sync_versions_published_total 2.0" in page
        assert f'rtrl_weight_sync_latest_version{{arm="{ARM}"}} 1.0' in page
    finally:
        publisher.close()
        proc.stop()


@pytest.mark.integration
def test_a_worker_apply_span_is_a_child_of_the_commit(
    otel_memory, server, publisher, policy_weights
):
    """Through the manifest: the publisher's span → weight_sync's commit span (in the
    stored manifest) → the apply span a follower opens from it."""
    from rtrl.inference.weights import WeightFollower
    from support.weight_sync import SUBSCRIBE_TOKEN

    spans, _ = otel_memory
    spans.clear()
    staged = threading.Event()

    def stage(version, weights) -> bool:
        staged.set()
        return True

    follower = WeightFollower(
        stage,
        server.addr,
        SUBSCRIBE_TOKEN,
        ARM,
        "worker-t",
        public_keys=MANIFEST_PUBLIC_KEYS,
    ).start()
    try:
        with trace.get_tracer("test").start_as_current_span("trainer.step") as step:
            publish_versions(publisher, policy_weights, 1)
        assert staged.wait(30)
        staged_version = wait.until(
            lambda: follower.staged(0), "the follower to record v0 as staged", timeout_s=10
        )
        assert staged_version is not None
        traceparent, _ = staged_version
    finally:
        follower.stop()
    finished = {span.name: span for span in spans.get_finished_spans()}
    publish, commit = finished["weights publish"], finished["weights commit"]
    assert publish.parent.span_id == step.get_span_context().span_id
    assert commit.parent.span_id == publish.context.span_id
    assert commit.context.trace_id == step.get_span_context().trace_id
    assert (
        traceparent
        == f"00-{commit.context.trace_id:032x}-{commit.context.span_id:016x}-{int(commit.context.trace_flags):02x}"
    )
