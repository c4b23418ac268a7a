"""The ingest process: HTTP and gRPC front ends over one Gateway, plus its heartbeat.

HTTP ``POST /v1/events`` takes the protobuf JSON mapping of PublishEventsRequest
(camelCase or original field names) and answers a JSON PublishEventsResponse:
  200  every event ACCEPTED or DUPLICATE
  207  some events REJECTED, the rest ACCEPTED/DUPLICATE (read the per-event results)
  400  every event REJECTED; or the body is not a PublishEventsRequest / too many events
       (then the body is ``{"error": ...}`` and no event was looked at)
  429  at least one event is RETRY (``Retry-After`` set); the others' results are final
gRPC ``rtrl.v1.Ingest/PublishEvents`` always answers OK with the same per-event results
(INVALID_ARGUMENT only for an oversized batch).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import grpc
import redis.asyncio as aioredis
from aiohttp import web
from google.protobuf import json_format

from ingest.config import IngestSettings
from ingest.gateway import REJECTED, RETRY, Gateway
from rtrl import heartbeat, kafka
from rtrl.config import StackSettings
from rtrl.runtime import until_stopped
from rtrl.v1 import ingest_pb2, ingest_pb2_grpc

log = logging.getLogger("ingest")

SERVICE = "ingest"
_GATEWAY = web.AppKey("gateway", Gateway)
_SETTINGS = web.AppKey("settings", IngestSettings)


def http_status(results: list[ingest_pb2.EventResult]) -> int:
    statuses = {r.status for r in results}
    if RETRY in statuses:
        return 429
    if REJECTED in statuses:
        return 400 if statuses == {REJECTED} else 207
    return 200


def build_http_app(gateway: Gateway, settings: IngestSettings) -> web.Application:
    app = web.Application(client_max_size=settings.max_body_bytes)
    app[_GATEWAY] = gateway
    app[_SETTINGS] = settings
    app.router.add_post("/v1/events", _post_events)
    app.router.add_get("/healthz", _healthz)
    return app


async def _post_events(request: web.Request) -> web.Response:
    gateway, settings = request.app[_GATEWAY], request.app[_SETTINGS]
    raw = await request.read()
    try:
        batch = json_format.Parse(raw.decode("utf-8"), ingest_pb2.PublishEventsRequest())
    except (UnicodeDecodeError, json_format.ParseError) as exc:
        return _error(400, f"body is not the JSON form of rtrl.v1.PublishEventsRequest: {exc}")
    if len(batch.events) > settings.max_batch:
        return _error(400, f"batch has {len(batch.events)} events, at most {settings.max_batch} allowed: split it")
    results = await gateway.publish(batch.events)
    status = http_status(results)
    headers = {"Retry-After": str(settings.retry_after_s)} if status == 429 else None
    body = json_format.MessageToJson(ingest_pb2.PublishEventsResponse(results=results), indent=None)
    return web.Response(status=status, text=body, content_type="application/json", headers=headers)


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", **request.app[_GATEWAY].status()})


def _error(status: int, message: str) -> web.Response:
    return web.Response(status=status, text=json.dumps({"error": message}), content_type="application/json")


class IngestServicer(ingest_pb2_grpc.IngestServicer):
    def __init__(self, gateway: Gateway, max_batch: int) -> None:
        self._gateway = gateway
        self._max_batch = max_batch

    async def PublishEvents(self, request: ingest_pb2.PublishEventsRequest, context: grpc.aio.ServicerContext) -> ingest_pb2.PublishEventsResponse:
        if len(request.events) > self._max_batch:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"batch has {len(request.events)} events, at most {self._max_batch} allowed")
        return ingest_pb2.PublishEventsResponse(results=await self._gateway.publish(request.events))


@dataclass
class IngestServer:
    """A started ingest service; ``stop()`` drains it."""

    gateway: Gateway
    producer: kafka.AsyncProducer
    redis: aioredis.Redis
    http_runner: web.AppRunner
    grpc_server: grpc.aio.Server
    heartbeat_task: asyncio.Task

    async def stop(self, grace_s: float = 5.0) -> None:
        # Stop taking requests first, then let in-flight produces reach the broker.
        await self.grpc_server.stop(grace_s)
        await self.http_runner.cleanup()
        self.heartbeat_task.cancel()
        await asyncio.gather(self.heartbeat_task, return_exceptions=True)
        undelivered = await asyncio.to_thread(self.producer.close)
        if undelivered:
            log.warning("%d events were still undelivered at shutdown (their clients got no ACCEPTED)", undelivered)
        await self.redis.aclose()


async def start(stack: StackSettings, settings: IngestSettings) -> IngestServer:
    await asyncio.to_thread(kafka.wait_for_broker, stack)
    await asyncio.to_thread(kafka.ensure_topics, stack)
    redis = aioredis.Redis.from_url(stack.redis_url)
    producer = kafka.AsyncProducer(stack, **{"message.timeout.ms": settings.produce_timeout_ms})
    gateway = Gateway(
        producer,
        redis,
        dedup_ttl_s=settings.dedup_ttl_s,
        claim_ttl_s=settings.claim_ttl_s,
        max_inflight=settings.max_inflight,
    )

    runner = web.AppRunner(build_http_app(gateway, settings), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, settings.bind_host, settings.http_port).start()

    options = [("grpc.max_receive_message_length", settings.max_body_bytes)]
    grpc_server = grpc.aio.server(options=options)
    ingest_pb2_grpc.add_IngestServicer_to_server(IngestServicer(gateway, settings.max_batch), grpc_server)
    if grpc_server.add_insecure_port(f"{settings.bind_host}:{settings.grpc_port}") == 0:
        raise RuntimeError(f"cannot bind gRPC to {settings.bind_host}:{settings.grpc_port}")
    await grpc_server.start()

    beats = asyncio.create_task(heartbeat.beat_forever(redis, SERVICE, stack.instance, gateway.status))
    log.info("ingest listening: http %s:%d, grpc %s:%d", settings.bind_host, settings.http_port, settings.bind_host, settings.grpc_port)
    return IngestServer(gateway, producer, redis, runner, grpc_server, beats)


async def serve(stack: StackSettings, settings: IngestSettings) -> None:
    """Run until SIGTERM or SIGINT, then drain."""
    server = await start(stack, settings)
    try:
        # A heartbeat that cannot reach Redis ends the process: the supervisor restarts it.
        await until_stopped(server.heartbeat_task)
    finally:
        await server.stop()


def main() -> None:
    settings = IngestSettings()
    stack = StackSettings()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(serve(stack, settings))
