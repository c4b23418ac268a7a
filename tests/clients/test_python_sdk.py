"""The client SDK: its on-disk spool, the name it gives on the wire, and delivery of every
event exactly once through killed gateways, cut connections and a killed product process.

Runs under every Python the client supports (test_client_pythons.py): nothing here imports
the server; the gateway is scripts/ingest_rig.py's (the ``gateway`` fixture)."""

import asyncio
import collections
import logging
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

import rtrl_client
from rtrl_client import sdk
from rtrl_client.client import IngestAuthError, IngestClient
from rtrl_client.sdk import RejectedEvent, Telemetry, TelemetrySettings
from rtrl_client.spool import Spool, SpoolFull, SpoolLocked
from rtrl_client.v1 import telemetry_pb2
from support import wait
from support.ingest_rig import IngestRig
from support.netfault import FaultProxy

# ---- the spool ----


def open_spool(directory: Path, *, max_bytes: int = 1 << 20, segment_bytes: int = 1 << 16) -> Spool:
    return Spool(directory, max_bytes=max_bytes, segment_bytes=segment_bytes)


def payloads(spool: Spool) -> list[bytes]:
    return [item.payload for item in spool.oldest(1 << 30)]


def segment_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.suffix in (".seg", ".acks"))


def test_spool_keeps_order_and_after_a_restart_resends_only_the_unanswered(tmp_path):
    spool = open_spool(tmp_path, segment_bytes=80)  # records of 20 bytes: four per segment
    seqs = [spool.append([b"event-%02d" % i])[0] for i in range(10)]
    seqs += spool.append([b"event-10", b"event-11"])
    assert payloads(spool) == [b"event-%02d" % i for i in range(12)]

    spool.ack([seqs[i] for i in (0, 1, 2, 3, 5, 11)])  # the first segment is answered whole
    assert segment_files(tmp_path) == [
        "0000000000000002.acks",
        "0000000000000002.seg",
        "0000000000000003.acks",
        "0000000000000003.seg",
    ]
    assert payloads(spool) == [b"event-%02d" % i for i in (4, 6, 7, 8, 9, 10)]
    spool.close()

    again = open_spool(tmp_path, segment_bytes=80)
    assert payloads(again) == [b"event-%02d" % i for i in (4, 6, 7, 8, 9, 10)]
    again.append([b"event-12"])  # appends go to a new segment after the ones found
    again.ack([item.seq for item in again.oldest(100)][:-1])
    again.close()

    last = open_spool(tmp_path, segment_bytes=80)
    assert payloads(last) == [b"event-12"]
    last.ack([item.seq for item in last.oldest(100)])
    assert (len(last), last.bytes, segment_files(tmp_path)) == (0, 0, [])


# Each case: what a crash left after two intact records.
TORN_TAILS = {
    "half a header": lambda record: record[:5],
    "header and half the payload": lambda record: record[: len(record) - 3],
    "a flipped payload byte (CRC)": lambda record: record[:-1] + bytes([record[-1] ^ 1]),
    "zeros a file system left": lambda record: b"\0" * len(record),
}


@pytest.mark.parametrize("torn", list(TORN_TAILS.values()), ids=list(TORN_TAILS))
def test_spool_cuts_a_torn_last_record_and_keeps_appending_after_it(tmp_path, torn):
    spool = open_spool(tmp_path)
    spool.append([b"first", b"second"])
    spool.close()
    (segment,) = tmp_path.glob("*.seg")
    intact = segment.read_bytes()
    third = open_spool(tmp_path / "scratch")
    third.append([b"third"])
    third.close()
    record = next((tmp_path / "scratch").glob("*.seg")).read_bytes()
    with open(segment, "ab") as file:  # the process died in the middle of appending "third"
        file.write(torn(record))

    again = open_spool(tmp_path)
    assert payloads(again) == [b"first", b"second"]
    assert segment.read_bytes() == intact
    again.append([b"fourth"])
    again.close()
    reopened = open_spool(tmp_path)
    assert payloads(reopened) == [b"first", b"second", b"fourth"]
    reopened.close()


def test_spool_ignores_a_torn_ack_and_an_ack_file_whose_segment_is_gone(tmp_path):
    spool = open_spool(tmp_path)
    seqs = spool.append([b"a", b"b", b"c"])
    spool.ack([seqs[0]])
    spool.close()
    (acks,) = tmp_path.glob("*.acks")
    with open(acks, "ab") as file:
        file.write(b"\0\0\0")  # a torn second ack: "b" is merely sent again
    (tmp_path / "0000000000000099.acks").write_bytes(b"\0" * 8)

    again = open_spool(tmp_path)
    assert payloads(again) == [b"b", b"c"]
    assert not (tmp_path / "0000000000000099.acks").exists()
    again.close()


def test_spool_full_refuses_the_event_until_answered_segments_free_space(tmp_path):
    spool = open_spool(tmp_path, max_bytes=200, segment_bytes=60)
    seqs = []
    with pytest.raises(SpoolFull, match="max_spool_bytes=200"):
        while True:
            seqs += spool.append([b"x" * 18])  # 30 bytes a record, two per segment
    assert spool.bytes <= 200 and len(spool) == len(seqs) == 6
    assert len(payloads(spool)) == 6  # the refused event left no trace

    spool.ack(seqs[1:2])  # half a segment answered: its disk is not free yet
    with pytest.raises(SpoolFull):
        spool.append([b"x" * 18])
    spool.ack(seqs[:1])
    spool.append([b"x" * 18])
    assert len(spool) == 5
    spool.close()


def test_a_batch_is_cut_by_bytes_but_always_carries_one_event(tmp_path):
    spool = open_spool(tmp_path)
    spool.append([b"a" * 100, b"b" * 100, b"c" * 300])
    assert [len(e.payload) for e in spool.oldest(10, max_bytes=250)] == [100, 100]
    assert [len(e.payload) for e in spool.oldest(1, max_bytes=250)] == [100]
    spool.ack([spool.oldest(2)[0].seq, spool.oldest(2)[1].seq])
    assert [len(e.payload) for e in spool.oldest(10, max_bytes=250)] == [300]
    spool.close()


def test_a_second_spool_on_the_same_directory_is_refused(tmp_path):
    spool = open_spool(tmp_path)
    with pytest.raises(SpoolLocked):
        open_spool(tmp_path)
    spool.close()
    open_spool(tmp_path).close()


def test_settings_refuse_inconsistent_values():
    with pytest.raises(ValueError, match="segment_bytes"):
        TelemetrySettings(max_spool_bytes=1000, segment_bytes=2000)
    with pytest.raises(ValueError, match="max_delay_s"):
        TelemetrySettings(base_delay_s=1.0, max_delay_s=0.5)


def test_helpers_fill_the_envelope_and_exactly_one_payload():
    who: dict[str, Any] = {"rollout_id": "r1", "session_id": "s1", "user_id": "u1"}
    events = [
        sdk.edit_shown(**who, file_path="a.py", edit_text="x = 1\n"),
        sdk.edit_outcome(**who, outcome="rejected", privacy_mode=True),
        sdk.persistence_snapshot(
            **who, seconds_after_edit=30.0, region_text="x = 1\n", client_ts_ms=123
        ),
        sdk.followup(**who, seconds_after_edit=5.0, message="no, that broke it"),
    ]
    assert [e.WhichOneof("payload") for e in events] == [
        "edit_shown",
        "edit_outcome",
        "persistence",
        "followup",
    ]
    assert len({e.event_id for e in events}) == 4
    assert all(
        e.schema_version == 1 and e.rollout_id == "r1" and e.client_ts_ms > 0 for e in events
    )
    assert (
        events[1].edit_outcome.outcome == telemetry_pb2.EditOutcome.OUTCOME_REJECTED
        and events[1].privacy_mode
    )
    assert events[2].client_ts_ms == 123 and events[3].followup.message == "no, that broke it"


WHO: dict[str, Any] = {"session_id": "s1", "user_id": "u1"}


# ---- the name on the wire ----


def test_every_request_names_the_sdk_and_its_version():
    """User-Agent for people reading logs, X-Rtrl-Sdk for the gateway's count (the header
    the TypeScript SDK sends too, as a browser's fetch may not set User-Agent)."""
    seen: list[dict[str, str]] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        body = await request.json()
        results = [{"eventId": e["eventId"], "status": "STATUS_ACCEPTED"} for e in body["events"]]
        return web.json_response({"results": results})

    async def scenario() -> None:
        app = web.Application()
        app.router.add_post("/v1/events", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with IngestClient(f"http://127.0.0.1:{port}", api_key="k") as client:
                event = sdk.followup(rollout_id="r", **WHO, seconds_after_edit=1.0, message="m")
                await client.publish([event])
                await client.publish([event], traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01")
        finally:
            await runner.cleanup()

    asyncio.run(scenario())
    version = rtrl_client.__version__
    python = f"{platform.python_implementation()}/{platform.python_version()}"
    assert [headers["User-Agent"] for headers in seen] == 2 * [
        f"rtrl-client-python/{version} {python} aiohttp/{aiohttp.__version__}"
    ]
    assert [headers["X-Rtrl-Sdk"] for headers in seen] == 2 * [f"rtrl-client-python/{version}"]


# ---- against the real gateway process ----


def report(telemetry: Telemetry, i: int) -> telemetry_pb2.TelemetryEvent:
    """Event i of a stream that cycles through the four payloads (and so all three topics)."""
    rollout = f"r{i // 4}"
    kind = i % 4
    if kind == 0:
        return telemetry.edit_shown(
            rollout_id=rollout, **WHO, file_path="a.py", edit_text=f"x = {i}\n"
        )
    if kind == 1:
        return telemetry.edit_outcome(rollout_id=rollout, **WHO, outcome="accepted")
    if kind == 2:
        return telemetry.persistence_snapshot(
            rollout_id=rollout, **WHO, seconds_after_edit=30.0, region_text=f"x = {i}\n"
        )
    return telemetry.followup(
        rollout_id=rollout, **WHO, seconds_after_edit=5.0, message="no, that broke it"
    )


@pytest.mark.integration
def test_rejected_events_are_final_a_refused_key_keeps_events_spooled_and_a_rate_limit_only_slows(
    gateway, api_key, tmp_path, caplog
):
    spool_dir = tmp_path / "spool"
    small = TelemetrySettings(max_spool_bytes=4096, segment_bytes=1024)
    refused = Telemetry(gateway.url, api_key="rtrl_not-a-key", spool_dir=spool_dir, settings=small)
    early = [report(refused, i) for i in range(3)]
    with pytest.raises(IngestAuthError, match="unknown API key") as raised:
        refused.flush(timeout_s=30)
    assert raised.value.status == 401 and refused.pending == 3
    with pytest.raises(SpoolFull):  # the gateway keeps refusing: the spool fills up, and says so
        while True:
            early.append(report(refused, len(early)))
    assert refused.pending == len(early) > 3
    assert (
        refused.close(timeout_s=1) is False
    )  # said in the log, not raised: the events stay spooled

    seen: list[RejectedEvent] = []
    bad = sdk.followup(rollout_id="r9", **WHO, seconds_after_edit=5.0, message="no")
    bad.schema_version = 2
    with caplog.at_level(logging.WARNING, logger="rtrl_client"):
        with Telemetry(
            gateway.url, api_key=api_key, spool_dir=spool_dir, on_rejected=seen.append
        ) as telemetry:
            assert telemetry.pending == len(early)  # found on disk
            telemetry.send([bad])
            late = report(telemetry, 99)
            assert telemetry.flush(timeout_s=30)
            assert (telemetry.stats.accepted, telemetry.stats.rejected, telemetry.pending) == (
                len(early) + 1,
                1,
                0,
            )
    assert [(r.event.event_id, r.field) for r in seen] == [(bad.event_id, "schema_version")]
    assert list(telemetry.rejected) == seen
    assert any(bad.event_id in m and "schema_version" in m for m in caplog.messages)
    assert not list(spool_dir.glob("*.seg"))

    # 120 events for a key limited to 40/s: the gateway answers 429 + Retry-After until the
    # bucket refills; delivery slows down, nothing is lost or refused for good.
    limited = gateway.key("sdk-limited", rate_per_s=40, burst=20)
    settings = TelemetrySettings(max_batch=20, linger_s=0)
    with Telemetry(
        gateway.url, api_key=limited, spool_dir=tmp_path / "limited", settings=settings
    ) as telemetry:
        throttled = [report(telemetry, i) for i in range(100, 220)]
        assert telemetry.flush(timeout_s=60)

    counts = gateway.count()
    assert counts == collections.Counter(e.event_id for e in early + [late] + throttled)


@pytest.mark.guarantee(1)
@pytest.mark.integration
def test_ten_thousand_events_arrive_once_through_gateway_kills_and_cut_connections(
    gateway, api_key, tmp_path
):
    total = 10_000
    # At these counts of reported events: reset every connection ("cut"), reset the one
    # carrying an answer in the middle of it ("lose answer": the gateway wrote the batch,
    # the SDK never learns it), or kill -9 the gateway and start it again (the SDK keeps
    # reporting into its spool while it is down).
    faults = {
        1_000: "cut",
        2_000: "kill",
        3_000: "lose answer",
        3_500: "cut",
        5_000: "cut",
        6_000: "kill",
        7_000: "lose answer",
        7_500: "cut",
        9_000: "cut",
    }
    settings = TelemetrySettings(max_batch=200, linger_s=0.02, max_delay_s=1.0)
    started = time.monotonic()
    in_doubt: set[str] = set()
    cut_connections, lost_answers = [], []
    with FaultProxy(gateway.http_port) as proxy:
        telemetry = Telemetry(
            f"http://{proxy.addr}", api_key=api_key, spool_dir=tmp_path / "spool", settings=settings
        )
        reported = []
        for i in range(total):
            if i in faults:
                # Each fault hits a live stream: the gateway has answered events since the last one.
                wait.until(
                    lambda: telemetry.stats.answered,
                    f"{i - 1_500} events answered",
                    ready=wait.at_least(i - 1_500),
                    timeout_s=60,
                    interval_s=0.01,
                )
                if faults[i] == "cut":
                    cut_connections.append(proxy.cut_all())
                elif faults[i] == "lose answer":
                    lost_answers.append(proxy.cut_after(2_000))  # a 200-event answer is ~20 kB
                else:
                    gateway.kill()
                    # What the killed gateway may have produced unanswered: the recovery
                    # sweep (ingest/recovery.py) settles it from the topic, once.
                    in_doubt |= gateway.claims()
                    gateway.start(wait=False)
            reported.append(report(telemetry, i).event_id)
        assert telemetry.flush(timeout_s=90), (
            f"{telemetry.pending} events undelivered: {telemetry.last_error!r}"
        )
        assert all(cut.is_set() for cut in lost_answers)
        assert telemetry.close()
        connections = proxy.connections
    elapsed = time.monotonic() - started

    counts = gateway.count()
    stats = telemetry.stats
    doubled = {event_id for event_id, n in counts.items() if n > 1}
    print(
        f"\n{total} events, {gateway.starts - 1} gateway kills, {len(cut_connections)} cuts "
        f"({sum(cut_connections)} connections reset), "
        f"{len(lost_answers)} answers cut mid-body, {connections} connections; "
        f"answers: {stats.accepted} accepted, {stats.duplicate} duplicate, {stats.retry} retry, "
        f"{len(in_doubt)} claims in flight at the kills, "
        f"{len(doubled)} of them written twice; {elapsed:.1f} s"
    )
    assert set(counts) == set(reported) and len(reported) == total
    assert stats.accepted + stats.duplicate == total and stats.rejected == 0
    assert not doubled, (
        f"written twice: {len(doubled)} events, {len(doubled & in_doubt)} of them claimed at a kill"
    )
    assert (
        all(cut_connections)
        and gateway.starts == 3
        and not list((tmp_path / "spool").glob("*.seg"))
    )


# A product process: reports events one by one and prints each event_id once the call
# returned (once the SDK promised delivery). It never calls close(): the exit hook delivers.
PRODUCT = (
    """
import logging
import sys
from rtrl_client.sdk import Telemetry, TelemetrySettings

logging.basicConfig(level=logging.INFO)
url, spool_dir, api_key, first, count, linger_s = sys.argv[1:]
settings = TelemetrySettings(max_batch=100, linger_s=float(linger_s))
telemetry = Telemetry(url, api_key=api_key, spool_dir=spool_dir, settings=settings)
for i in range(int(first), int(first) + int(count)):
    event = telemetry.edit_shown(rollout_id=f"r{i}", session_id="s1", user_id="u1", """
    """file_path="a.py", edit_text=f"x = {i}\\n")
    print(event.event_id, flush=True)
"""
)


@pytest.mark.guarantee(1)
@pytest.mark.integration
def test_a_product_killed_mid_stream_resends_its_spool_on_restart_and_nothing_is_lost_or_doubled(
    gateway, api_key, tmp_path
):
    spool_dir = tmp_path / "spool"
    promised: list[str] = []
    # Answers trickle back slowly, so the product reports faster than the gateway's answers
    # arrive: the kill finds events in the spool and an answer half received. Once this
    # test stops reading, the product blocks on its full stdout pipe (reporting no more).
    with (
        FaultProxy(gateway.http_port, bytes_per_s=20_000) as proxy,
        open(tmp_path / "product.log", "ab") as log,
    ):
        product = subprocess.Popen(
            [
                sys.executable,
                "-c",
                PRODUCT,
                f"http://{proxy.addr}",
                str(spool_dir),
                api_key,
                "0",
                "10000",
                "0.01",
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        assert product.stdout is not None  # stdout=PIPE
        for line in product.stdout:
            promised.append(line.strip())
            if len(promised) == 1_000:
                break
        wait.until(
            lambda: gateway.counters()["accepted"],
            "the gateway to take 200 of the product's events",
            ready=lambda accepted: accepted >= 200,
            interval_s=0.01,
        )
        product.send_signal(signal.SIGKILL)
        product.wait(timeout=30)
        promised += [line.strip() for line in product.stdout if len(line.strip()) == 36]
        product.stdout.close()
    assert product.returncode == -signal.SIGKILL and 1_000 <= len(promised) < 10_000
    answered_before_kill = gateway.counters()["accepted"]
    spool = Spool(spool_dir, max_bytes=1 << 30, segment_bytes=1 << 20)
    left_in_spool = len(spool)
    spool.close()
    assert answered_before_kill > 0 and left_in_spool > 0

    # The same product starts again on the same spool, by host name, reports 500 more and exits.
    restarted = subprocess.run(
        [
            sys.executable,
            "-c",
            PRODUCT,
            f"http://localhost:{gateway.http_port}",
            str(spool_dir),
            api_key,
            "20000",
            "500",
            "0.01",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert restarted.returncode == 0, restarted.stderr
    assert "will be resent" in restarted.stderr
    promised += restarted.stdout.split()

    counts = gateway.count()
    answers = gateway.counters()
    print(
        f"\nproduct killed after {len(promised) - 500} promised events "
        f"({answered_before_kill} accepted, {left_in_spool} left in its spool); "
        f"after the restart: {answers['accepted']} accepted, {answers['duplicate']} duplicate answers in all"
    )
    assert len(set(promised)) == len(promised)
    assert all(counts[event_id] == 1 for event_id in promised) and max(counts.values()) == 1
    # At most one event was in the spool but not printed yet when the kill came.
    assert len(set(counts) - set(promised)) <= 1
    assert not list(spool_dir.glob("*.seg"))


@pytest.mark.integration
def test_the_exit_hook_delivers_what_a_product_never_closed(gateway, api_key, tmp_path):
    # linger_s=60: nothing is sent before the interpreter exits, so even the host name is
    # first resolved in the exit hook (where aiohttp's default threaded resolver fails).
    product = subprocess.run(
        [
            sys.executable,
            "-c",
            PRODUCT,
            f"http://localhost:{gateway.http_port}",
            str(tmp_path / "spool"),
            api_key,
            "0",
            "50",
            "60",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert product.returncode == 0, product.stderr
    assert gateway.count() == collections.Counter(product.stdout.split())
    assert len(product.stdout.split()) == 50 and not list((tmp_path / "spool").glob("*.seg"))


@pytest.mark.integration
def test_the_gateway_counts_the_events_this_sdk_sent_under_its_name_and_version(
    gateway: IngestRig, api_key, tmp_path
):
    bad = sdk.followup(rollout_id="r1", **WHO, seconds_after_edit=5.0, message="no")
    bad.schema_version = 2
    with Telemetry(gateway.url, api_key=api_key, spool_dir=tmp_path / "spool") as telemetry:
        for i in range(3):
            report(telemetry, i)
        telemetry.send([bad])
        assert telemetry.flush(timeout_s=30)
    name = ("rtrl-client-python", rtrl_client.__version__)
    counted = gateway.sdk_events()
    assert (counted[(*name, "accepted")], counted[(*name, "rejected")]) == (3, 1), counted
    assert {labels[:2] for labels in counted} == {name}
