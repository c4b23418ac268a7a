"""Events counted by the SDK that sent them (ingest/sdk_counts.py): the X-Rtrl-Sdk header
(gRPC metadata x-rtrl-sdk) parsed against an allow-list, and a label set no client can
grow past its bound, however many versions it forges."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import aiohttp
import grpc
import pytest
from google.protobuf import json_format

from rtrl import procs
from rtrl.ingest import sdk_counts
from rtrl.ingest.sdk_counts import MAX_VERSIONS, OTHER, SdkCounts, parse_sdk
from rtrl_client.v1 import ingest_pb2, ingest_pb2_grpc
from support.gateway import GatewayProcess, issue
from support.ingest import shown
from support.ingest_rig import sdk_events

# Each case: an X-Rtrl-Sdk value and the (sdk, sdk_version) labels it counts under.
HEADERS = {
    "rtrl-client-python/0.2.0": ("rtrl-client-python", "0.2.0"),
    "rtrl-client-ts/0.2.0": ("rtrl-client-ts", "0.2.0"),
    "rtrl-client-ts/1.10.3-rc.1": ("rtrl-client-ts", "1.10.3-rc.1"),
    "rtrl-client-python/0.3.0rc1": ("rtrl-client-python", "0.3.0rc1"),
    "rtrl-client-python/0.3.0.dev2": ("rtrl-client-python", "0.3.0.dev2"),
    # not an SDK of ours, or not its bare name and version
    "": (OTHER, OTHER),
    "curl/8.5.0": (OTHER, OTHER),
    "rtrl-client-go/0.2.0": (OTHER, OTHER),
    "rtrl-client-python/0.2.0 CPython/3.12.1": (OTHER, OTHER),  # a User-Agent, not the header
    "RTRL-CLIENT-PYTHON/0.2.0": (OTHER, OTHER),
    "rtrl-client-python/0.2": (OTHER, OTHER),
    "rtrl-client-python/v0.2.0": (OTHER, OTHER),
    "rtrl-client-python/12345.0.0": (OTHER, OTHER),  # five digits
    "rtrl-client-python/0.2.0-" + "x" * 40: (OTHER, OTHER),  # past MAX_HEADER_CHARS
    "rtrl-client-python/٠.٢.٠": (OTHER, OTHER),  # Arabic-Indic digits: \d would take them
    'rtrl-client-python/0.2.0"} 1\nfake_metric{a="': (OTHER, OTHER),  # exposition injection
    "rtrl-client-python/0.2.0/../../x": (OTHER, OTHER),
}


@pytest.mark.parametrize(("header", "labels"), list(HEADERS.items()), ids=list(HEADERS))
def test_the_header_names_an_sdk_only_in_the_allowed_grammar(header, labels):
    assert parse_sdk(header) == labels


def test_versions_past_the_cap_count_under_their_sdk_as_other():
    accepted = ingest_pb2.EventResult(status=ingest_pb2.EventResult.STATUS_ACCEPTED)
    counts = SdkCounts(max_versions=2)
    for header in ("rtrl-client-ts/0.2.0", "rtrl-client-python/0.2.0", "rtrl-client-ts/0.3.0"):
        counts.count(header, [accepted])
    counts.count("rtrl-client-ts/0.2.0", [accepted, accepted])  # a kept version stays itself
    counts.count("nonsense", [accepted])
    assert sorted((labels["sdk"], labels["sdk_version"], n) for n, labels in counts.readings()) == [
        (OTHER, OTHER, 1),
        ("rtrl-client-python", "0.2.0", 1),
        ("rtrl-client-ts", "0.2.0", 3),
        ("rtrl-client-ts", OTHER, 1),
    ]


@pytest.fixture
def gateway_with_metrics(stack_env, repo_root, tmp_path):
    metrics_port = procs.free_port()
    process = GatewayProcess(
        {**stack_env, "RTRL_METRICS_PORT": str(metrics_port)}, repo_root, tmp_path / "ingest.log"
    )
    process.start()
    yield process, f"http://127.0.0.1:{metrics_port}/metrics"
    process.stop()


def scrape(metrics_url: str) -> dict[tuple[str, str, str], float]:
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        return sdk_events(response.read().decode())


async def _flood(url: str, key: str, headers: list[str]) -> list[int]:
    """One request per header, each with one event the gateway rejects (nothing is written)."""
    event = shown("r-flood")
    event.schema_version = 2
    body = json.dumps({"events": [json_format.MessageToDict(event)]})
    limit = asyncio.Semaphore(16)

    async def send(http: aiohttp.ClientSession, header: str) -> int:
        async with limit:
            async with http.post(
                f"{url}/v1/events",
                data=body,
                headers={"Authorization": f"Bearer {key}", sdk_counts.HEADER: header},
            ) as response:
                return response.status

    async with aiohttp.ClientSession() as http:
        return await asyncio.gather(*(send(http, header) for header in headers))


@pytest.mark.integration
def test_a_thousand_forged_versions_leave_the_exported_series_bounded(
    gateway_with_metrics, redis_url
):
    gateway, metrics_url = gateway_with_metrics
    key = issue(redis_url, "forger")
    # The real SDKs first: their labels are kept whatever comes after.
    real = ["rtrl-client-python/0.2.0", "rtrl-client-ts/0.2.0"]
    forged = [f"rtrl-client-python/1.{i // 100}.{i % 100}" for i in range(1000)]
    garbage = [f"rtrl-client-go/{i}.0.0" for i in range(200)] + [f"x{i}" * 10 for i in range(200)]
    statuses = asyncio.run(_flood(gateway.url, key, real + forged + garbage))
    assert set(statuses) == {400}  # each batch answered: every event REJECTED

    # gRPC: the SDK's name in the metadata, beside gRPC's own user-agent.
    event = shown("r-grpc")
    event.schema_version = 2
    with grpc.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
        stub = ingest_pb2_grpc.IngestStub(channel)
        for header in ("rtrl-client-ts/0.2.0", "rtrl-client-python/9.9.9"):
            with pytest.raises(grpc.RpcError) as refused:  # every event invalid
                stub.PublishEvents(
                    ingest_pb2.PublishEventsRequest(events=[event]),
                    metadata=[("authorization", f"Bearer {key}"), ("x-rtrl-sdk", header)],
                    timeout=10,
                )
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    counted = scrape(metrics_url)
    labels = {(sdk, version) for sdk, version, _ in counted}
    others = {labels: n for labels, n in counted.items() if OTHER in labels}
    print(f"\n{len(real + forged + garbage) + 2} requests: {len(labels)} label pairs; {others}")
    assert len(labels) <= MAX_VERSIONS + len(sdk_counts.SDK_NAMES) + 1
    assert counted[("rtrl-client-python", "0.2.0", "rejected")] == 1
    assert counted[("rtrl-client-ts", "0.2.0", "rejected")] == 2  # HTTP and gRPC
    assert counted[(OTHER, OTHER, "rejected")] == len(garbage)
    python_versions = [v for sdk, v, _ in counted if sdk == "rtrl-client-python" and v != OTHER]
    assert len(python_versions) == MAX_VERSIONS - 1  # the TypeScript 0.2.0 holds one place
    assert sum(counted.values()) == len(real + forged + garbage) + 2
