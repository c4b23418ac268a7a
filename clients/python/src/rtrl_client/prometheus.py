"""The SDK's Prometheus metrics, for a product process that serves its own /metrics.

    from prometheus_client import REGISTRY
    from rtrl_client.prometheus import TelemetryCollector

    REGISTRY.register(TelemetryCollector(telemetry, client="editor"))

Read at scrape time from the ``Telemetry``; nothing is counted twice. The alert rules in
deploy/prometheus/alerts.yml watch the spool: a spool that only grows means the gateway
has not answered for a while (down, unreachable, or refusing the key). Needs the
``prometheus`` extra (``pip install 'rtrl-client[prometheus]'``).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rtrl_client.sdk import Telemetry


class TelemetryCollector(Collector):
    def __init__(self, telemetry: Telemetry, *, client: str = "default") -> None:
        """``client``: the label telling apart several Telemetry objects in one process."""
        self._telemetry = telemetry
        self._client = client

    def collect(self) -> Iterator[Metric]:
        t, labels = self._telemetry, ["client"]
        stats = t.stats
        gauges = (
            (
                "rtrl_sdk_spool_events",
                "Events spooled and not answered by the gateway yet.",
                t.pending,
            ),
            (
                "rtrl_sdk_spool_bytes",
                "Disk the spool uses, counted against its limit.",
                t.spool_bytes,
            ),
            (
                "rtrl_sdk_spool_limit_bytes",
                "The spool's limit (TelemetrySettings.max_spool_bytes): past it, reports raise SpoolFull.",
                t.settings.max_spool_bytes,
            ),
            (
                "rtrl_sdk_spool_oldest_age_seconds",
                "How long the oldest unanswered event has waited in the spool.",
                t.oldest_pending_age_s,
            ),
        )
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            gauge.add_metric([self._client], value)
            yield gauge
        delivered = CounterMetricFamily(
            "rtrl_sdk_delivered_events",
            "Events the gateway has (ACCEPTED, or DUPLICATE: it had it already), by answer.",
            labels=[*labels, "answer"],
        )
        delivered.add_metric([self._client, "accepted"], stats.accepted)
        delivered.add_metric([self._client, "duplicate"], stats.duplicate)
        yield delivered
        counters = (
            (
                "rtrl_sdk_rejected_events",
                "Events the gateway REJECTED (final; see on_rejected).",
                stats.rejected,
            ),
            (
                "rtrl_sdk_retried_events",
                "RETRY answers and events given up on for a round, all resent later.",
                stats.retry,
            ),
            (
                "rtrl_sdk_refused_requests",
                "Requests refused whole (a refused key, a malformed batch).",
                stats.refused_requests,
            ),
        )
        for name, doc, value in counters:
            counter = CounterMetricFamily(name, doc, labels=labels)
            counter.add_metric([self._client], value)
            yield counter
