"""The shared conformance vectors (clients/conformance/) against the Python SDK: the same
files the TypeScript SDK's tests read (clients/typescript/test/conformance.test.mjs).

events.json: each helper call encodes to the expected protobuf wire bytes and JSON mapping.
statuses.json: the real gateway (Tansu, Redis, API keys; scripts/ingest_rig.py) answers each
case's event with the expected status and rejected field, lands it on a topic exactly once or
never, and refuses bad keys with IngestAuthError. Runs under every Python the client supports
(test_client_pythons.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format

from rtrl_client import sdk
from rtrl_client.client import IngestAuthError, IngestClient
from rtrl_client.v1 import ingest_pb2, telemetry_pb2

CONFORMANCE = Path(__file__).resolve().parents[2] / "clients" / "conformance"
EVENTS = json.loads((CONFORMANCE / "events.json").read_text())["cases"]
STATUSES = json.loads((CONFORMANCE / "statuses.json").read_text())


def build(case: dict[str, Any]) -> telemetry_pb2.TelemetryEvent:
    """The case's event: its helper called with its args, then its JSON overrides applied
    (a null removes the key)."""
    event = getattr(sdk, case["helper"])(**case["args"])
    if "event_id" in case:
        event.event_id = case["event_id"]
    override = case.get("override")
    if not override:
        return event
    document = json_format.MessageToDict(event)
    document.update(override)
    document = {key: value for key, value in document.items() if value is not None}
    return json_format.ParseDict(document, telemetry_pb2.TelemetryEvent())


def test_the_vectors_cover_every_helper_and_status():
    """Guards the vector files themselves: a case dropped by mistake fails here."""
    assert {case["helper"] for case in EVENTS} == {
        "edit_shown",
        "edit_outcome",
        "persistence_snapshot",
        "followup",
    }
    statuses = {e["status"] for case in STATUSES["cases"] for e in case["expect"]}
    assert statuses == {"ACCEPTED", "DUPLICATE", "REJECTED"}
    assert STATUSES["auth_cases"]


@pytest.mark.parametrize("case", EVENTS, ids=[case["name"] for case in EVENTS])
def test_helpers_encode_to_the_shared_wire_bytes_and_json(case):
    event = build(case)
    assert event.SerializeToString().hex() == case["wire_hex"]
    assert json_format.MessageToDict(event) == case["json"]
    # And back: the vector's bytes and JSON decode to the same event.
    assert telemetry_pb2.TelemetryEvent.FromString(bytes.fromhex(case["wire_hex"])) == event
    assert json_format.ParseDict(case["json"], telemetry_pb2.TelemetryEvent()) == event


async def _publish_cases(url: str, key: str) -> list[tuple[telemetry_pb2.TelemetryEvent, list]]:
    """Each case's event published `sends` times, one request each, and its results."""
    answered = []
    async with IngestClient(url, api_key=key, max_attempts=3) as client:
        for case in STATUSES["cases"]:
            event = build(case)
            results = [(await client.publish([event]))[0] for _ in range(case.get("sends", 1))]
            answered.append((event, results))
    return answered


async def _refused_keys(url: str) -> list[int | None]:
    """The HTTP status of the IngestAuthError each auth case raised (None: nothing raised)."""
    statuses: list[int | None] = []
    for case in STATUSES["auth_cases"]:
        async with IngestClient(url, api_key=case["api_key"]) as client:
            try:
                await client.publish([build(STATUSES["cases"][0])])
                statuses.append(None)
            except IngestAuthError as exc:
                statuses.append(exc.status)
    return statuses


@pytest.mark.integration
def test_the_gateway_answers_each_case_as_the_vectors_say(gateway):
    key = gateway.key("conformance")
    answered = asyncio.run(_publish_cases(gateway.url, key))
    refused = asyncio.run(_refused_keys(gateway.url))
    landed = gateway.count()
    for case, (event, results) in zip(STATUSES["cases"], answered, strict=True):
        got = [
            {"status": ingest_pb2.EventResult.Status.Name(r.status).removeprefix("STATUS_")}
            | ({"field": r.field} if r.field else {})
            for r in results
        ]
        assert got == case["expect"], (case["name"], [r.error for r in results])
        if case["expect"][0]["status"] == "REJECTED":
            assert all(r.error for r in results), case["name"]  # the reason reaches the caller
        assert landed[event.event_id] == (1 if case["lands"] else 0), case["name"]
    assert refused == [case["http_status"] for case in STATUSES["auth_cases"]]
