"""`rtrl bench ingest`: events/s through the gateway against a bare producer.

On a fresh Tansu broker and Redis, the gateway (``python -m rtrl.ingest``, API keys
required, as deployed) takes batches of realistic ~1 KB events over gRPC from
``concurrency`` clients in this process. The baseline is a bare confluent-kafka
producer in this process sending the same serialized events, keyed the same way,
to the same topics of the same broker. The two alternate for ``rounds`` rounds;
each figure is the best round, and ``ratio`` is gateway / raw.

The load generator behaves as a client should: it resends events answered RETRY
(backpressure). Every event is also checked: none refused, and the broker's end
offsets grew by exactly the number sent (nothing lost, nothing doubled).
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from rich.console import Console
from rich.table import Table

from rtrl import procs, topics
from rtrl.bench import report
from rtrl.bench.report import code_version
from rtrl.bench.stack import scratch_stack
from rtrl.config import StackSettings

EVENT_BYTES = 1024


# Produced by run; written to bench/results/ingest.json; read by its test and docs/benchmarks.md.
@dataclass(frozen=True)
class IngestBench:
    events_per_s: float
    """Through the gateway, best round."""
    raw_producer_events_per_s: float
    """The baseline: a bare confluent-kafka producer, best round."""
    ratio: float
    """events_per_s over the baseline's."""
    event_bytes: int
    batch: int
    """Events per gateway request."""
    concurrency: int
    """Gateway requests in flight."""
    events_per_round: int
    rounds: int
    gateway_rounds: tuple[float, ...]
    """The gateway's events/s in each round."""
    raw_rounds: tuple[float, ...]
    """The bare producer's events/s in each round."""
    exact: bool
    """Every gateway event ACCEPTED and the topics grew by exactly the events sent."""
    sent: int
    landed: int
    """Growth of the topics' end offsets over the timed rounds (raw and gateway)."""
    not_accepted: int
    """Gateway events answered neither ACCEPTED nor RETRY (RETRY ones are resent, as clients do)."""
    resent: int
    code_version: str
    key_verify_us: float = 0.0
    """Verifying the operator's signature on one API key record (once per key per cache TTL)."""
    rollout_sign_us: float = 0.0
    """Signing one rollout record of the demo's size (the serving API, once per completion)."""
    rollout_verify_us: float = 0.0
    """Verifying it (the joiner, once per rollout)."""
    rollout_bytes: int = 0
    event_mac_us: float = 0.0
    """Authenticating one event of event_bytes (the gateway, once per event; the joiner's
    check costs the same)."""


class SignatureCosts(TypedDict):
    """signature_costs' measurements: the IngestBench fields of the same names."""

    key_verify_us: float
    rollout_sign_us: float
    rollout_verify_us: float
    rollout_bytes: int
    event_mac_us: float


def signature_costs(repeats: int = 2_000) -> SignatureCosts:
    """Microseconds per record for what the trust boundary adds around ingest, in this
    process: the key record check (rtrl/api_keys.py) and the rollout signature the serving
    API makes and the joiner checks (a real completion's record, from the demo's engine)."""
    from rtrl import signing
    from rtrl.api_keys import KeyAuthority, KeyVerifier, key_hash
    from rtrl.bench.join_load import rollout_records

    operator = signing.generate_private_key()
    digest = key_hash("rtrl_bench")
    record = KeyAuthority(operator).signed(
        digest, {"client_id": "bench", "scopes": "*,completions", "rate_per_s": "0.0"}
    )
    verifier = KeyVerifier([signing.public_key_of(operator)])
    start = time.perf_counter()
    assert all(verifier.problem(digest, record) is None for _ in range(repeats))
    key_verify = time.perf_counter() - start

    worker = signing.generate_private_key()
    signer = signing.Signer(worker, signing.Purpose.ROLLOUT)
    rollouts = [rollout_records(f"r{i:06d}", 0)[0][1] for i in range(repeats)]
    start = time.perf_counter()
    headers = [signer.headers(value) for value in rollouts]
    signed = time.perf_counter() - start
    check = signing.Verifier([signing.public_key_of(worker)], signing.Purpose.ROLLOUT)
    start = time.perf_counter()
    assert not any(
        check.problem(value, header) for value, header in zip(rollouts, headers, strict=True)
    )
    verified = time.perf_counter() - start

    events = [event.SerializeToString() for event in make_events(repeats)]
    # As the gateway seals each event: a MAC for the joiner, one for the analytics sink.
    mac = signing.Seal(
        signing.MacSigner(signing.generate_mac_key(), signing.Purpose.EVENT),
        signing.MacSigner(signing.generate_mac_key(), signing.Purpose.EVENT),
    )
    start = time.perf_counter()
    for value in events:
        mac.headers(value)
    authenticated = time.perf_counter() - start
    return {
        "key_verify_us": round(key_verify / repeats * 1e6, 1),
        "rollout_sign_us": round(signed / repeats * 1e6, 1),
        "rollout_verify_us": round(verified / repeats * 1e6, 1),
        "rollout_bytes": round(sum(map(len, rollouts)) / repeats),
        "event_mac_us": round(authenticated / repeats * 1e6, 2),
    }


def make_events(n: int, seed: int = 0) -> list:
    """Edit-shown events of about EVENT_BYTES serialized, over many rollouts."""
    from rtrl_client.client import make_event
    from rtrl_client.v1 import telemetry_pb2

    now_ms = time.time_ns() // 1_000_000
    body = ("    return helper(value)  # keep the house style\n" * 40)[: EVENT_BYTES - 190]
    events = []
    for i in range(n):
        event = make_event(
            f"rollout-{seed}-{i // 4}",
            f"session-{i // 64}",
            f"user-{i % 997}",
            edit_shown=telemetry_pb2.EditShown(file_path=f"src/module_{i % 50}.py", edit_text=body),
            client_ts_ms=now_ms,
        )
        events.append(event)
    return events


def raw_round(stack: StackSettings, events: list) -> float:
    from confluent_kafka import Producer

    from rtrl.kafka import producer_config

    records = [
        (topics.BY_PAYLOAD[e.WhichOneof("payload")], e.SerializeToString(), e.rollout_id.encode())
        for e in events
    ]
    producer = Producer(producer_config(stack))
    started = time.perf_counter()
    for topic, value, key in records:
        while True:
            try:
                producer.produce(topic, value, key=key)
                break
            except BufferError:
                producer.poll(0.01)
        producer.poll(0)
    left = producer.flush(60)
    elapsed = time.perf_counter() - started
    if left:
        raise RuntimeError(f"raw producer: {left} events unacknowledged after 60 s")
    return len(records) / elapsed


async def gateway_round(
    addr: str, key: str, events: list, batch: int, concurrency: int
) -> tuple[float, int, int]:
    """(events/s, events neither ACCEPTED nor RETRY, RETRY answers resent), as a client
    that resends what the gateway asked it to retry."""
    import grpc

    from rtrl_client.v1 import ingest_pb2

    queue: asyncio.Queue[tuple[list, bytes]] = asyncio.Queue()
    for start in range(0, len(events), batch):
        chunk = events[start : start + batch]
        queue.put_nowait((chunk, ingest_pb2.PublishEventsRequest(events=chunk).SerializeToString()))
    answers = _Answers()
    async with grpc.aio.insecure_channel(
        addr, options=[("grpc.max_receive_message_length", 64 << 20)]
    ) as channel:
        call = channel.unary_unary(
            "/rtrl.v1.Ingest/PublishEvents",
            request_serializer=None,
            response_deserializer=ingest_pb2.PublishEventsResponse.FromString,
        )
        metadata = (("authorization", f"Bearer {key}"),)
        started = time.perf_counter()
        await asyncio.gather(*(_client(call, metadata, queue, answers) for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return len(events) / elapsed, answers.refused, answers.resent


@dataclass
class _Answers:
    """What gateway_round's clients tally as they go (one event loop: no lock)."""

    refused: int = 0
    """Events answered neither ACCEPTED nor RETRY."""
    resent: int = 0


async def _client(
    call: Callable[..., Awaitable[Any]],
    metadata: tuple[tuple[str, str], ...],
    queue: asyncio.Queue[tuple[list, bytes]],
    answers: _Answers,
) -> None:
    """One client: sends batches from ``queue`` until it is empty, each until the gateway
    has answered every event of it with something other than RETRY."""
    import grpc

    from rtrl_client.v1 import ingest_pb2

    retry = ingest_pb2.EventResult.STATUS_RETRY
    while not queue.empty():
        chunk, body = queue.get_nowait()
        while True:
            try:
                answer = await call(body, metadata=metadata, timeout=60)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                answers.resent += len(chunk)
                await asyncio.sleep(0.05)
                continue
            # One result per event, in order (the gateway's contract; the SDK checks it).
            again = [
                event for event, r in zip(chunk, answer.results, strict=True) if r.status == retry
            ]
            answers.refused += sum(
                r.status not in (ingest_pb2.EventResult.STATUS_ACCEPTED, retry)
                for r in answer.results
            )
            if not again:
                break
            answers.resent += len(again)
            chunk, body = again, ingest_pb2.PublishEventsRequest(events=again).SerializeToString()
            await asyncio.sleep(0.05)


def _end_total(stack: StackSettings) -> int:
    from rtrl import kafka

    return sum(kafka.end_offsets(stack, kafka.partitions(stack, (topics.EDIT,))).values())


@contextmanager
def gateway(
    stack: StackSettings, workdir: Path, operator_key: str, max_inflight: int
) -> Iterator[str]:
    """``python -m rtrl.ingest`` on ``stack``, API keys required (signed by ``operator_key``),
    as deployed; yields its gRPC address once it listens, stops it on the way out."""
    from rtrl import signing

    http_port, grpc_port = procs.free_port(), procs.free_port()
    env = {
        "RTRL_KAFKA_BOOTSTRAP": stack.kafka_bootstrap,
        "RTRL_REDIS_URL": stack.redis_url,
        "RTRL_STATE_DIR": str(stack.state_dir),
        "RTRL_INGEST_HTTP_PORT": str(http_port),
        "RTRL_INGEST_GRPC_PORT": str(grpc_port),
        "RTRL_INGEST_MAX_INFLIGHT": str(max_inflight),
        "RTRL_OTEL_EXPORTER": "none",
        "RTRL_API_KEY_PUBLIC_KEYS": signing.public_key_of(operator_key),
        "RTRL_INGEST_EVENT_KEY": signing.generate_mac_key(),
        "RTRL_INGEST_ANALYTICS_EVENT_KEY": signing.generate_mac_key(),
        "PYTHONPATH": str(Path(__file__).resolve().parent.parent)
        + os.pathsep
        + os.environ.get("PYTHONPATH", ""),
    }
    proc = procs.spawn(
        "ingest",
        [sys.executable, "-m", "rtrl.ingest"],
        workdir / "ingest.log",
        env=env,
        port=grpc_port,
    )
    try:
        procs.wait_for_port(grpc_port, timeout_s=60)
        yield f"127.0.0.1:{grpc_port}"
    finally:
        proc.stop()


# Produced by timed_rounds; read by run for IngestBench and its table.
@dataclass(frozen=True)
class Rounds:
    """The timed rounds: each side's rate per round, and the exactness check over them all."""

    gateway_rates: tuple[float, ...]
    raw_rates: tuple[float, ...]
    refused: int
    """Gateway events answered neither ACCEPTED nor RETRY."""
    resent: int
    sent: int
    """Events sent, by both sides."""
    landed: int
    """Growth of the topics' end offsets over the rounds."""

    @property
    def exact(self) -> bool:
        return self.refused == 0 and self.landed == self.sent


def timed_rounds(
    stack: StackSettings,
    addr: str,
    key: str,
    events_per_round: int,
    batch: int,
    concurrency: int,
    rounds: int,
    console: Console,
) -> Rounds:
    """The bare producer then the gateway, ``rounds`` times, each on fresh events."""
    gateway_rates, raw_rates, refused, resent, sent = [], [], 0, 0, 0
    before = _end_total(stack)
    for round_index in range(rounds):
        raw_rates.append(raw_round(stack, make_events(events_per_round, seed=2 * round_index)))
        rate, not_accepted, again = asyncio.run(
            gateway_round(
                addr,
                key,
                make_events(events_per_round, seed=2 * round_index + 1),
                batch,
                concurrency,
            )
        )
        gateway_rates.append(rate)
        refused += not_accepted
        resent += again
        sent += 2 * events_per_round
        console.print(
            f"round {round_index + 1}/{rounds}: raw producer {raw_rates[-1]:,.0f} events/s, "
            f"gateway {rate:,.0f} events/s"
        )
    landed = _end_total(stack) - before
    return Rounds(tuple(gateway_rates), tuple(raw_rates), refused, resent, sent, landed)


def run(
    out: Path,
    console: Console,
    *,
    events_per_round: int = 60_000,
    batch: int = 500,
    concurrency: int = 8,
    rounds: int = 3,
) -> IngestBench:
    from rtrl import signing
    from rtrl.api_keys import KeyAuthority, call_sync, issue_key
    from rtrl.kafka import ensure_topics, wait_for_broker

    operator_key = (
        signing.generate_private_key()
    )  # the bench's own operator: it signs the bench's key
    with (
        tempfile.TemporaryDirectory(prefix="rtrl-bench-ingest-") as tmp,
        scratch_stack(Path(tmp)) as stack,
    ):
        wait_for_broker(stack)
        ensure_topics(stack)
        with gateway(stack, Path(tmp), operator_key, batch * concurrency * 2) as addr:
            key = call_sync(stack.redis_url, issue_key, KeyAuthority(operator_key), "bench")
            # Warm both paths (connections, topic metadata, the gateway's scripts).
            raw_round(stack, make_events(2_000, seed=-1))
            asyncio.run(gateway_round(addr, key, make_events(2_000, seed=-2), batch, concurrency))
            measured = timed_rounds(
                stack, addr, key, events_per_round, batch, concurrency, rounds, console
            )
    best_gateway, best_raw = max(measured.gateway_rates), max(measured.raw_rates)
    result = IngestBench(
        events_per_s=round(best_gateway),
        raw_producer_events_per_s=round(best_raw),
        ratio=round(best_gateway / best_raw, 3),
        event_bytes=len(make_events(1)[0].SerializeToString()),
        batch=batch,
        concurrency=concurrency,
        events_per_round=events_per_round,
        rounds=rounds,
        gateway_rounds=tuple(round(r) for r in measured.gateway_rates),
        raw_rounds=tuple(round(r) for r in measured.raw_rates),
        exact=measured.exact,
        sent=measured.sent,
        landed=measured.landed,
        not_accepted=measured.refused,
        resent=measured.resent,
        code_version=code_version("ingest"),
        **signature_costs(),
    )
    report.write(out, result)
    _print(result, measured, console)
    return result


def _print(result: IngestBench, measured: Rounds, console: Console) -> None:
    table = Table(
        title=f"rtrl bench ingest ({result.event_bytes} B events, batches of {result.batch}, "
        f"{result.concurrency} in flight)",
        title_justify="left",
    )
    for column in ("path", "events/s (best round)", "rounds", "ratio"):
        table.add_column(column, justify="left" if column == "path" else "right")
    table.add_row(
        "bare confluent-kafka producer",
        f"{max(measured.raw_rates):,.0f}",
        ", ".join(f"{r:,.0f}" for r in measured.raw_rates),
        "1.00",
    )
    table.add_row(
        "gateway (gRPC, keys, dedup, validation)",
        f"{max(measured.gateway_rates):,.0f}",
        ", ".join(f"{r:,.0f}" for r in measured.gateway_rates),
        f"{result.ratio:.2f}",
    )
    console.print(table)
    console.print(
        f"exact: {measured.exact}: {measured.sent:,} sent, the topics grew by {measured.landed:,}, "
        f"{measured.refused} gateway events refused, {measured.resent} resent after RETRY"
    )
    console.print(
        f"signatures: {result.key_verify_us} us to verify an API key record (per key per cache TTL); "
        f"{result.rollout_sign_us} us to sign a {result.rollout_bytes:,}-byte rollout (the serving API), "
        f"{result.rollout_verify_us} us to verify it (the joiner); "
        f"{result.event_mac_us} us to authenticate a {result.event_bytes:,}-byte event (the gateway)"
    )
