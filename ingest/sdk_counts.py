"""Which SDK versions send the gateway's events, counted under labels a client cannot multiply.

Both SDKs name themselves on every request: HTTP header ``X-Rtrl-Sdk:
rtrl-client-python/0.2.0`` (or ``rtrl-client-ts/0.2.0``), gRPC metadata ``x-rtrl-sdk``. The
gateway counts each answered event by that name, version and outcome
(``rtrl_ingest_sdk_events_total{sdk, sdk_version, outcome}``), so an operator sees which
versions still send before dropping one.

The header is whatever the client says, so it is parsed against an allow-list rather than
copied into a label: one of ``SDK_NAMES``, a slash, a release version (three numbers of at
most four digits, optionally a suffix such as ``-rc.1`` or PEP 440's ``rc1``/``.dev2``), at
most ``MAX_HEADER_CHARS`` in all, ASCII only. Anything else, a missing header included,
counts as ``other``/``other``. The first ``MAX_VERSIONS`` distinct (sdk, version) pairs are
kept as labels; later ones count under their SDK with version ``other``. Whatever clients
send, the exported series are at most ``(MAX_VERSIONS + len(SDK_NAMES) + 1) * len(OUTCOMES)``.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable

from rtrl_client.v1 import ingest_pb2

HEADER = "X-Rtrl-Sdk"
"""The HTTP header naming the SDK; gRPC metadata keys are lower case (``x-rtrl-sdk``)."""
SDK_NAMES = ("rtrl-client-python", "rtrl-client-ts")
OTHER = "other"
MAX_HEADER_CHARS = 64
MAX_VERSIONS = 32
"""Distinct (sdk, version) label pairs kept, across SDKs: a few releases of each live at once."""

OUTCOMES = {
    ingest_pb2.EventResult.STATUS_ACCEPTED: "accepted",
    ingest_pb2.EventResult.STATUS_DUPLICATE: "duplicate",
    ingest_pb2.EventResult.STATUS_REJECTED: "rejected",
    ingest_pb2.EventResult.STATUS_RETRY: "retry",
}
"""An event's result -> its ``outcome`` label (the values of ``rtrl_ingest_events_total``)."""

_SDK = re.compile(
    "(" + "|".join(map(re.escape, SDK_NAMES)) + r")/"
    r"([0-9]{1,4}\.[0-9]{1,4}\.[0-9]{1,4}(?:[-.]?[0-9A-Za-z]{1,16}(?:\.[0-9A-Za-z]{1,16}){0,3})?)"
)


def parse_sdk(header: str) -> tuple[str, str]:
    """(sdk, version) named by an ``X-Rtrl-Sdk`` value, or (other, other)."""
    if len(header) > MAX_HEADER_CHARS:
        return OTHER, OTHER
    named = _SDK.fullmatch(header)
    return (named[1], named[2]) if named else (OTHER, OTHER)


class SdkCounts:
    """Events answered per (sdk, version, outcome). Counted on the gateway's event loop,
    read by the metrics exporter's thread (``readings``); the lock keeps the two apart."""

    def __init__(self, max_versions: int = MAX_VERSIONS) -> None:
        self.max_versions = max_versions
        self._labels: dict[str, tuple[str, str]] = {}
        """Header value -> its labels, for the values that earned a label of their own."""
        self._counts: dict[tuple[str, str, str], int] = {}
        self._lock = threading.Lock()

    def labels(self, header: str) -> tuple[str, str]:
        """The (sdk, sdk_version) labels a request with this header counts under."""
        known = self._labels.get(header)
        if known is not None:
            return known
        sdk, version = parse_sdk(header)
        if sdk == OTHER:
            return OTHER, OTHER
        if len(self._labels) >= self.max_versions:
            return sdk, OTHER
        self._labels[header] = (sdk, version)
        return sdk, version

    def count(self, header: str, results: Iterable[ingest_pb2.EventResult]) -> None:
        """One request's answered events, under the labels of its ``X-Rtrl-Sdk`` header."""
        sdk, version = self.labels(header)
        with self._lock:
            for result in results:
                key = (sdk, version, OUTCOMES[result.status])
                self._counts[key] = self._counts.get(key, 0) + 1

    def readings(self) -> list[tuple[int, dict[str, str]]]:
        """(events, labels) per series, for ``otel.observe``."""
        with self._lock:
            counts = list(self._counts.items())
        return [
            (n, {"sdk": sdk, "sdk_version": version, "outcome": outcome})
            for (sdk, version, outcome), n in counts
        ]
