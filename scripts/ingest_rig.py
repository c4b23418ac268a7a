"""A real ingest gateway for the client SDKs' tests (clients/typescript), driven over stdin/stdout.

    .venv/bin/python scripts/ingest_rig.py [--cors-origin http://127.0.0.1:PORT ...]

Starts, on free ports and in a private temporary directory: a memory-only Tansu broker, a
redis-server, the topics, an API key signed by a throwaway operator key, and the gateway
as production runs it (``python -m rtrl.ingest``, API keys required) in a process group of
its own, so it can be SIGKILLed and started again on the same ports. Then answers one JSON
line on stdout per JSON line on stdin:

  {"cmd": "kill"}                    SIGKILL the gateway (nothing drained)  {"ok": true}
  {"cmd": "start"}                   start it again on the same ports, once listening
                                     ("wait": false: at once)               {"ok": true}
  {"cmd": "count"}                   {"ok": true, "counts": {event_id: times on the telemetry topics}}
  {"cmd": "key", "client_id": "c"}   a new API key ("rate_per_s", "burst": its rate limit)
                                                                            {"ok": true, "key": "rtrl_..."}
  {"cmd": "claims"}                  event ids claimed and not settled: what a killed gateway
                                     may have produced unanswered           {"ok": true, "claims": [...]}
  {"cmd": "quit"}                    stop everything (so does EOF on stdin)  {"ok": true}

A failed command answers {"ok": false, "error": "..."}. The first line is
{"ready": true, "url": ..., "metrics_url": ..., "api_key": ..., "log": ...}; logs stay in
that directory; metrics_url is the gateway's Prometheus page (RTRL_METRICS_PORT).
The gateway's claims expire after 3 s (RTRL_INGEST_CLAIM_TTL_S), so events a killed gateway
was producing are taken again 3 s later. ``--cors-origin`` lets pages of that origin send
events from a browser (RTRL_INGEST_CORS_ORIGINS).

The rig runs on the server's interpreter (``.venv/bin/python``); the SDK under test may run
on any other and reaches it over HTTP only (tests/clients, clients/typescript/test).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import redis.asyncio as aioredis
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from rtrl import kafka, procs, signing, topics
from rtrl.api_keys import KeyAuthority, issue_key
from rtrl.config import StackSettings
from rtrl.ingest.gateway import DEDUP_PREFIX
from rtrl_client.v1 import telemetry_pb2

TELEMETRY_TOPICS = (topics.EDIT, topics.PERSISTENCE, topics.FOLLOWUP)
REPO_ROOT = Path(__file__).resolve().parent.parent


class Rig:
    def __init__(self, workdir: Path, cors_origins: list[str]) -> None:
        self.workdir = workdir
        self.tansu = procs.start_tansu(workdir / "tansu.log")
        self.redis = procs.start_redis(workdir / "redis", workdir / "redis.log")
        self.stack = StackSettings(
            kafka_bootstrap=f"127.0.0.1:{self.tansu.port}",
            redis_url=f"redis://127.0.0.1:{self.redis.port}/0",
            state_dir=workdir / "state",
            kafka_partitions=2,
        )
        kafka.ensure_topics(self.stack)
        operator_key = signing.generate_private_key()
        self.authority = KeyAuthority(operator_key)
        self.http_port, grpc_port, metrics_port = procs.free_ports(3)
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        self.env = {
            "PYTHONPATH": str(REPO_ROOT),
            "RTRL_KAFKA_BOOTSTRAP": self.stack.kafka_bootstrap,
            "RTRL_REDIS_URL": self.stack.redis_url,
            "RTRL_STATE_DIR": str(self.stack.state_dir),
            "RTRL_KAFKA_PARTITIONS": str(self.stack.kafka_partitions),
            "RTRL_API_KEY_PUBLIC_KEYS": signing.public_key_of(operator_key),
            "RTRL_INGEST_EVENT_KEY": signing.generate_mac_key(),
            "RTRL_INGEST_ANALYTICS_EVENT_KEY": signing.generate_mac_key(),
            "RTRL_INGEST_HTTP_PORT": str(self.http_port),
            "RTRL_INGEST_GRPC_PORT": str(grpc_port),
            "RTRL_INGEST_AUTH_REQUIRED": "true",
            "RTRL_INGEST_CLAIM_TTL_S": "3",
            "RTRL_INGEST_PRODUCE_TIMEOUT_MS": "2000",
            "RTRL_INGEST_KEY_CACHE_TTL_S": "0.5",
            "RTRL_INGEST_CORS_ORIGINS": json.dumps(cors_origins),
            "RTRL_METRICS_PORT": str(metrics_port),
        }
        self.gateway: procs.Proc | None = None
        self.start()

    def start(self, wait: bool = True) -> None:
        if self.gateway is not None and self.gateway.alive():
            raise RuntimeError("the gateway is running")
        self.gateway = procs.spawn(
            "ingest",
            [sys.executable, "-m", "rtrl.ingest"],
            self.workdir / "ingest.log",
            env=self.env,
            port=self.http_port,
        )
        if wait:
            procs.wait_for_port(self.http_port, timeout_s=30)

    def kill(self) -> None:
        if self.gateway is None or not self.gateway.alive():
            raise RuntimeError("the gateway is not running")
        os.killpg(self.gateway.pid, signal.SIGKILL)
        self.gateway.popen.wait()

    def key(
        self, client_id: str, rate_per_s: float | None = None, burst: float | None = None
    ) -> str:
        async def issue() -> str:
            client = aioredis.Redis.from_url(self.stack.redis_url)
            try:
                return await issue_key(
                    client, self.authority, client_id, rate_per_s=rate_per_s, burst=burst
                )
            finally:
                await client.aclose()

        return asyncio.run(issue())

    def claims(self) -> list[str]:
        """Event ids whose dedup key still says pending (ingest/gateway.py's protocol)."""

        async def read() -> list[str]:
            client = aioredis.Redis.from_url(self.stack.redis_url)
            try:
                keys = [key async for key in client.scan_iter(match=DEDUP_PREFIX + "*", count=1000)]
                values = await client.mget(keys) if keys else []
            finally:
                await client.aclose()
            return [
                key.decode().removeprefix(DEDUP_PREFIX)
                for key, value in zip(keys, values, strict=True)
                if value == b"pending"
            ]

        return asyncio.run(read())

    def count(self, timeout_s: float = 30.0) -> dict[str, int]:
        """How many times each event_id is on the telemetry topics, read from the beginning
        to the end offsets."""
        probe = Consumer(kafka.consumer_config(self.stack, "ingest-rig-reader"))
        try:
            metadata = probe.list_topics(timeout=5).topics
            tps = [
                TopicPartition(t, p, OFFSET_BEGINNING)
                for t in TELEMETRY_TOPICS
                for p in metadata[t].partitions
            ]
            remaining = {k: v for k, v in kafka.end_offsets(self.stack, tps).items() if v > 0}
            counts: collections.Counter[str] = collections.Counter()
            probe.assign(tps)
            deadline = time.monotonic() + timeout_s
            while remaining and time.monotonic() < deadline:
                for msg in probe.consume(1000, timeout=0.2):
                    if msg.error() is not None:
                        raise RuntimeError(str(msg.error()))
                    topic, partition, offset = kafka.record_position(msg)
                    value = msg.value()
                    if value is not None:
                        counts[telemetry_pb2.TelemetryEvent.FromString(value).event_id] += 1
                    if offset + 1 >= remaining.get((topic, partition), 0):
                        remaining.pop((topic, partition), None)
        finally:
            probe.close()
        if remaining:
            raise RuntimeError(f"could not read up to the end offsets: {remaining}")
        return dict(counts)

    def stop(self) -> None:
        for proc in (self.gateway, self.redis, self.tansu):
            if proc is not None:
                proc.stop(timeout_s=5)


def answer(rig: Rig, command: dict) -> dict:
    cmd = command.get("cmd")
    if cmd == "kill":
        rig.kill()
        return {"ok": True}
    if cmd == "start":
        rig.start(wait=bool(command.get("wait", True)))
        return {"ok": True}
    if cmd == "count":
        return {"ok": True, "counts": rig.count()}
    if cmd == "claims":
        return {"ok": True, "claims": rig.claims()}
    if cmd == "key":
        client_id = str(command.get("client_id", "rig-client"))
        return {
            "ok": True,
            "key": rig.key(client_id, command.get("rate_per_s"), command.get("burst")),
        }
    raise ValueError(f"unknown command {cmd!r}")


def say(document: dict) -> None:
    sys.stdout.write(json.dumps(document) + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cors-origin", action="append", default=[], help="repeatable")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="rtrl-ingest-rig-"))
    rig = Rig(workdir, args.cors_origin)
    # SIGTERM (a test runner tearing down) stops the children like EOF does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        say(
            {
                "ready": True,
                "url": rig.url,
                "metrics_url": rig.metrics_url,
                "api_key": rig.key("rig-client"),
                "log": str(workdir / "ingest.log"),
            }
        )
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                command = json.loads(line)
                if command.get("cmd") == "quit":
                    break
                say(answer(rig, command))
            except Exception as exc:  # the caller reads the error; the rig keeps serving
                say({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        say({"ok": True})
    finally:
        rig.stop()


if __name__ == "__main__":
    main()
