"""The ingest gateway as its own process (``python -m rtrl.ingest``, killable and
restartable on the same ports), API keys for it, and a count of what landed on the
telemetry topics. Shared by the SDK tests of both clients (tests/clients)."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

import redis.asyncio as aioredis
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from rtrl import kafka, procs, topics
from rtrl.api_keys import issue_key
from rtrl.procs import free_port
from rtrl_client.v1 import telemetry_pb2
from support.signing import KEY_AUTHORITY

INGEST_TOPICS = (topics.EDIT, topics.PERSISTENCE, topics.FOLLOWUP)


class GatewayProcess:
    """``python -m rtrl.ingest`` on fixed ports, as in production: killable and restartable."""

    def __init__(
        self, stack_env: dict[str, str], repo_root: Path, log_path: Path, **settings
    ) -> None:
        self.http_port, self.grpc_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.log_path = log_path
        self.env = {
            **stack_env,
            "PYTHONPATH": str(repo_root),
            "RTRL_INGEST_HTTP_PORT": str(self.http_port),
            "RTRL_INGEST_GRPC_PORT": str(self.grpc_port),
            **{f"RTRL_INGEST_{name.upper()}": str(value) for name, value in settings.items()},
        }
        self.proc: procs.Proc | None = None
        self.starts = 0

    def start(self, *, wait: bool = True) -> None:
        self.proc = procs.spawn(
            "ingest",
            [sys.executable, "-m", "rtrl.ingest"],
            self.log_path,
            env=self.env,
            port=self.http_port,
        )
        self.starts += 1
        if wait:
            procs.wait_for_port(self.http_port, timeout_s=30)

    def kill(self) -> None:
        assert self.proc is not None, "not started"
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.popen.wait()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def counters(self) -> dict:
        """What this gateway process answered since it started (GET /healthz)."""
        with urllib.request.urlopen(f"{self.url}/healthz", timeout=5) as response:
            return json.load(response)


def issue(redis_url: str, client_id: str, **limits) -> str:
    async def run() -> str:
        client = aioredis.Redis.from_url(redis_url)
        try:
            return await issue_key(client, KEY_AUTHORITY, client_id, **limits)
        finally:
            await client.aclose()

    return asyncio.run(run())


def event_ids_on_topics(
    stack_settings, names=INGEST_TOPICS, timeout_s: float = 60.0
) -> collections.Counter:
    """How many times each event_id is on the ingest topics, read from the beginning to the end offsets."""
    probe = Consumer(kafka.consumer_config(stack_settings, "sdk-test-reader"))
    metadata = probe.list_topics(timeout=5).topics
    tps = [TopicPartition(t, p, OFFSET_BEGINNING) for t in names for p in metadata[t].partitions]
    remaining = {k: v for k, v in kafka.end_offsets(stack_settings, tps).items() if v > 0}
    counts: collections.Counter = collections.Counter()
    probe.assign(tps)
    deadline = time.monotonic() + timeout_s
    try:
        while remaining and time.monotonic() < deadline:
            for msg in probe.consume(1000, timeout=0.2):
                assert msg.error() is None, msg.error()
                topic, partition, offset = kafka.record_position(msg)
                value = msg.value()
                assert value is not None, (topic, partition, offset)
                event = telemetry_pb2.TelemetryEvent.FromString(value)
                assert (
                    msg.key() == event.rollout_id.encode()
                    and topic == topics.BY_PAYLOAD[event.WhichOneof("payload")]
                )
                counts[event.event_id] += 1
                if offset + 1 >= remaining.get((topic, partition), 0):
                    remaining.pop((topic, partition), None)
    finally:
        probe.close()
    assert not remaining, f"could not read up to the end offsets: {remaining}"
    return counts
