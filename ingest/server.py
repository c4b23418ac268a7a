"""The ingest process: HTTP and gRPC front ends over one Gateway, plus its heartbeat.

Every request carries an API key (``Authorization: Bearer <key>``; gRPC metadata
``authorization``), checked against rtrl/api_keys.py before its body is looked at.

HTTP ``POST /v1/events`` takes the protobuf JSON mapping of PublishEventsRequest
(camelCase or original field names) and answers a JSON PublishEventsResponse:
  200  every event ACCEPTED or DUPLICATE
  207  some events REJECTED, the rest ACCEPTED/DUPLICATE (read the per-event results)
  400  every event REJECTED; or the body is not a PublishEventsRequest / too many events
       (then the body is ``{"error": ...}`` and no event was looked at)
  401  no API key, an unknown one, a revoked or expired one (``{"error": ...}``)
  403  the key may send none of the batch's event types
  413  the body is larger than max_body_bytes
  429  at least one event is RETRY (``Retry-After`` set); the others' results are final;
       or the key's rate limit is spent (``{"error": ...}``, nothing was looked at)
gRPC ``rtrl.v1.Ingest/PublishEvents`` answers OK with the same per-event results, or:
  INVALID_ARGUMENT    the request does not parse, has too many events, or every event is
                      invalid (the details name each event's field and reason)
  UNAUTHENTICATED     / PERMISSION_DENIED as 401 / 403
  RESOURCE_EXHAUSTED  rate limit spent, or no event admitted (backpressure); trailing
                      metadata ``retry-after`` in seconds. Also, from gRPC itself and
                      without ``retry-after``, a message over max_body_bytes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

import aiohttp
import aiohttp.http_exceptions
import grpc
import redis.asyncio as aioredis
from aiohttp import web
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry import metrics

from rtrl import entrypoint, heartbeat, kafka, otel, signing
from rtrl.api_keys import ApiKey, KeyCache, KeyVerifier, RateLimiter, bearer_key
from rtrl.config import StackSettings
from rtrl.ingest.config import IngestSettings
from rtrl.ingest.gateway import REJECTED, RETRY, Gateway
from rtrl.runtime import bounded, service_process, until_stopped
from rtrl.v1 import ingest_pb2, telemetry_pb2

log = logging.getLogger("ingest")

SERVICE = "ingest"
_GATEWAY = web.AppKey("gateway", Gateway)
_SETTINGS = web.AppKey("settings", IngestSettings)


@dataclass(frozen=True)
class Refusal:
    """A whole request refused before its events were looked at."""

    http_status: int
    grpc_code: grpc.StatusCode
    message: str
    retry_after_s: float = 0.0


class Door:
    """Authentication and rate limiting, shared by both front ends."""

    def __init__(self, keys: KeyCache | None, limiter: RateLimiter | None) -> None:
        self._keys = keys
        self._limiter = limiter
        self.refused: Counter[int] = Counter()
        """Requests refused, by HTTP status (401, 403, 429)."""

    @property
    def keys(self) -> KeyCache | None:
        return self._keys

    async def authenticate(self, authorization: str) -> tuple[ApiKey | None, Refusal | None]:
        """Who is asking: from the Authorization header alone, before any of the body is read."""
        key, refusal = await self._authenticate(authorization)
        if refusal is not None:
            self.refused[refusal.http_status] += 1
        return key, refusal

    async def authorize(
        self, key: ApiKey | None, events: Sequence[telemetry_pb2.TelemetryEvent]
    ) -> Refusal | None:
        """May this key send these events now (scope, rate)?"""
        refusal = await self._authorize(key, events)
        if refusal is not None:
            self.refused[refusal.http_status] += 1
        return refusal

    async def _authenticate(self, authorization: str) -> tuple[ApiKey | None, Refusal | None]:
        if self._keys is None:
            return None, None
        key, why = await bearer_key(self._keys, authorization)
        if why is not None:
            return key, Refusal(401, grpc.StatusCode.UNAUTHENTICATED, why)
        return key, None

    async def _authorize(
        self, key: ApiKey | None, events: Sequence[telemetry_pb2.TelemetryEvent]
    ) -> Refusal | None:
        if key is None or self._limiter is None:
            return None
        kinds = {event.WhichOneof("payload") for event in events} - {None}
        if kinds and not any(key.allows(kind) for kind in kinds):
            allowed = ", ".join(sorted(key.scopes))
            return Refusal(
                403,
                grpc.StatusCode.PERMISSION_DENIED,
                f"the API key of client {key.client_id!r} may send only {allowed}, not {', '.join(sorted(kinds))}",
            )
        wait_s = await self._limiter.take(key, len(events))
        if wait_s > 0:
            return Refusal(
                429,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"rate limit of client {key.client_id!r} ({key.rate_per_s:g} events/s) spent: retry in {wait_s:.2f} s",
                retry_after_s=wait_s,
            )
        return None


_DOOR = web.AppKey("door", Door)


def http_status(results: list[ingest_pb2.EventResult]) -> int:
    statuses = {r.status for r in results}
    if RETRY in statuses:
        return 429
    if REJECTED in statuses:
        return 400 if statuses == {REJECTED} else 207
    return 200


def build_http_app(
    gateway: Gateway, settings: IngestSettings, door: Door | None = None
) -> web.Application:
    app = web.Application(client_max_size=settings.max_body_bytes)
    app[_GATEWAY] = gateway
    app[_SETTINGS] = settings
    app[_DOOR] = door or Door(None, None)
    app.router.add_post("/v1/events", _post_events)
    app.router.add_get("/healthz", _healthz)
    return app


async def _post_events(request: web.Request) -> web.Response:
    gateway, settings, door = request.app[_GATEWAY], request.app[_SETTINGS], request.app[_DOOR]
    # Cheap checks first: who is asking, from the headers alone, before a byte of the body
    # is read, decompressed or parsed.
    key, refusal = await door.authenticate(request.headers.get("Authorization", ""))
    if refusal is not None:
        return _refused(refusal)
    raw = await _read_body(request, settings)
    if isinstance(raw, web.Response):
        return raw
    try:
        text = raw.decode("utf-8")
        batch = json_format.Parse(text, ingest_pb2.PublishEventsRequest())
        problem = _json_type_error(
            json.loads(text), ingest_pb2.PublishEventsRequest.DESCRIPTOR, "PublishEventsRequest"
        )
        if problem:
            raise json_format.ParseError(problem)
    except (UnicodeDecodeError, json_format.ParseError) as exc:
        return _error(400, f"body is not the JSON form of rtrl.v1.PublishEventsRequest: {exc}")
    if len(batch.events) > settings.max_batch:
        return _error(
            400,
            f"batch has {len(batch.events)} events, at most {settings.max_batch} allowed: split it",
        )
    refusal = await door.authorize(key, batch.events)
    if refusal is not None:
        return _refused(refusal)
    results = await gateway.publish(
        batch.events, key=key, traceparent=request.headers.get("traceparent", "")
    )
    status = http_status(results)
    headers = {"Retry-After": str(settings.retry_after_s)} if status == 429 else None
    body = json_format.MessageToJson(ingest_pb2.PublishEventsResponse(results=results), indent=None)
    return web.Response(status=status, text=body, content_type="application/json", headers=headers)


ACCEPTED_ENCODINGS = ("identity", "gzip", "deflate")


async def _read_body(request: web.Request, settings: IngestSettings) -> bytes | web.Response:
    """The body, decompressed, or the refusal: at most max_body_bytes, and a compressed body
    at most max_inflation times its Content-Length (a 93 KB gzip that expands to 61 MB stops
    at the bound, read no further)."""
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower() or "identity"
    if encoding not in ACCEPTED_ENCODINGS:
        return _error(
            415,
            f"Content-Encoding {encoding!r} is not accepted: send {', '.join(ACCEPTED_ENCODINGS)}",
        )
    limit, why = (
        settings.max_body_bytes,
        f"body is larger than {settings.max_body_bytes} bytes: split the batch",
    )
    if encoding != "identity":
        if request.content_length is None:
            return _error(411, f"a {encoding} body needs a Content-Length")
        if settings.max_inflation * request.content_length < limit:
            limit = settings.max_inflation * request.content_length
            why = f"{encoding} body expands past {settings.max_inflation}x its {request.content_length} bytes"
    body = bytearray()
    try:
        async for chunk in request.content.iter_any():
            body += chunk
            if len(body) > limit:
                return _error(413, why)
    except (
        web.RequestPayloadError,
        aiohttp.ClientPayloadError,
        aiohttp.http_exceptions.HttpProcessingError,
    ) as exc:
        return _error(400, f"body does not decode ({encoding}): {exc}")
    return bytes(body)


def _refused(refusal: Refusal) -> web.Response:
    headers = (
        {"Retry-After": str(math.ceil(refusal.retry_after_s))} if refusal.retry_after_s else None
    )
    return _error(refusal.http_status, refusal.message, headers)


def _json_type_error(value, descriptor, path: str) -> str | None:
    """Where the JSON has a type the proto3 JSON mapping does not allow but protobuf's
    Python parser takes: [] or "" for a message, a bool for a number, 1.5 for an enum."""
    if not isinstance(value, dict):
        return f"{path} must be a JSON object"
    for field in descriptor.fields:
        for key in {field.name, field.json_name}:
            item = value.get(key)
            if item is None:
                continue
            for i, element in enumerate(
                item if field.is_repeated and isinstance(item, list) else [item]
            ):
                where = f"{path}.{key}[{i}]" if field.is_repeated else f"{path}.{key}"
                if field.message_type is not None:
                    problem = _json_type_error(element, field.message_type, where)
                    if problem:
                        return problem
                elif isinstance(element, bool) and field.cpp_type != field.CPPTYPE_BOOL:
                    return f"{where} must not be a bool"
                elif isinstance(element, float) and field.enum_type is not None:
                    return f"{where} must be an enum name or number"
    return None


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", **asdict(request.app[_GATEWAY].status())})


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status,
        text=json.dumps({"error": message}),
        content_type="application/json",
        headers=headers,
    )


class IngestServicer:
    """``rtrl.v1.Ingest/PublishEvents`` over raw bytes: a request that does not parse is
    answered INVALID_ARGUMENT with the parser's reason (a generated servicer would
    fail it as INTERNAL before any code of ours ran)."""

    def __init__(self, gateway: Gateway, settings: IngestSettings, door: Door) -> None:
        self._gateway = gateway
        self._settings = settings
        self._door = door

    def handler(self) -> grpc.GenericRpcHandler:
        method = grpc.unary_unary_rpc_method_handler(
            self.publish_events,
            request_deserializer=None,
            response_serializer=ingest_pb2.PublishEventsResponse.SerializeToString,
        )
        return grpc.method_handlers_generic_handler("rtrl.v1.Ingest", {"PublishEvents": method})

    async def publish_events(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> ingest_pb2.PublishEventsResponse:
        metadata = dict(context.invocation_metadata() or ())
        # Who is asking, from the metadata alone, before the request is parsed.
        key, refusal = await self._door.authenticate(metadata.get("authorization", ""))
        if refusal is not None:
            await context.abort(refusal.grpc_code, refusal.message)
        try:
            request = ingest_pb2.PublishEventsRequest.FromString(raw)
        except DecodeError as exc:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request is not a serialized rtrl.v1.PublishEventsRequest: {exc}",
            )
        events = request.events
        if len(events) > self._settings.max_batch:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"batch has {len(events)} events, at most {self._settings.max_batch} allowed",
            )
        refusal = await self._door.authorize(key, events)
        if refusal is not None:
            if refusal.retry_after_s:
                context.set_trailing_metadata(
                    (("retry-after", str(math.ceil(refusal.retry_after_s))),)
                )
            await context.abort(refusal.grpc_code, refusal.message)
        results = await self._gateway.publish(
            events, key=key, traceparent=metadata.get("traceparent", "")
        )
        statuses = {r.status for r in results}
        if results and statuses == {REJECTED}:
            problems = "; ".join(
                f"event {i} ({r.event_id[:40]!r}): {r.field}: {r.error}"
                for i, r in enumerate(results[:20])
            )
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"every event is invalid: {problems}"
            )
        if results and statuses == {RETRY}:
            context.set_trailing_metadata((("retry-after", str(self._settings.retry_after_s)),))
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"no event admitted: {results[0].error}"
            )
        return ingest_pb2.PublishEventsResponse(results=results)


@dataclass
class IngestServer:
    """A started ingest service; ``stop()`` drains it."""

    gateway: Gateway
    producer: kafka.AsyncProducer
    redis: aioredis.Redis
    http_runner: web.AppRunner
    grpc_server: grpc.aio.Server
    heartbeat_task: asyncio.Task
    recovery_task: asyncio.Task
    door: Door | None = None

    async def stop(self, grace_s: float = 5.0) -> None:
        # Stop taking requests first, then let in-flight produces reach the broker. Every
        # step is bounded, so a stuck one is logged by name and shutdown still ends.
        log.info("ingest stopping: draining requests (grace %.0f s)", grace_s)
        self.recovery_task.cancel()
        self.heartbeat_task.cancel()
        await bounded("gRPC drain", self.grpc_server.stop(grace_s), grace_s + 2)
        await bounded("HTTP drain", self.http_runner.cleanup(), grace_s)
        await bounded(
            "background tasks",
            asyncio.gather(self.recovery_task, self.heartbeat_task, return_exceptions=True),
            2,
        )
        undelivered = await bounded("producer flush", _in_daemon_thread(self.producer.close), 15)
        if undelivered:
            log.warning(
                "%d events were still undelivered at shutdown (their clients got no ACCEPTED)",
                undelivered,
            )
        await bounded("Redis close", self.redis.aclose(), 2)
        log.info("ingest stopped")


async def start(stack: StackSettings, settings: IngestSettings) -> IngestServer:
    await asyncio.to_thread(kafka.wait_for_broker, stack)
    await asyncio.to_thread(kafka.ensure_topics, stack)
    event_key = settings.event_key.get_secret_value()
    if not event_key:
        raise SystemExit(
            "RTRL_INGEST_EVENT_KEY is not set: the gateway authenticates every event it writes "
            "and has no default key (python -m rtrl.signing prints one)"
        )
    try:
        signer = signing.MacSigner(event_key, signing.Purpose.EVENT)
    except ValueError as exc:
        raise SystemExit(f"RTRL_INGEST_EVENT_KEY: {exc}") from None
    redis = aioredis.Redis.from_url(stack.redis_url)
    producer = kafka.AsyncProducer(stack, **{"message.timeout.ms": settings.produce_timeout_ms})
    gateway = Gateway(
        producer,
        redis,
        signer=signer,
        dedup_ttl_s=settings.dedup_ttl_s,
        claim_ttl_s=settings.claim_ttl_s,
        max_inflight=settings.max_inflight,
        client_ts_window=settings.client_ts_window(),
    )

    if settings.auth_required:
        if not stack.api_key_public_keys.strip():
            raise SystemExit(
                "RTRL_API_KEY_PUBLIC_KEYS is not set: "
                "the gateway accepts only API keys the operator signed (rtrl up derives it)"
            )
        verifier = KeyVerifier(signing.parse_public_keys(stack.api_key_public_keys))
        door = Door(KeyCache(redis, settings.key_cache_ttl_s, verifier), RateLimiter(redis))
    else:
        door = Door(None, None)
        log.warning("RTRL_INGEST_AUTH_REQUIRED=false: accepting events without an API key")

    runner = web.AppRunner(build_http_app(gateway, settings, door), access_log=None)
    await runner.setup()
    await web.TCPSite(
        runner, settings.bind_host, settings.http_port, ssl_context=settings.http_context()
    ).start()

    options = [("grpc.max_receive_message_length", settings.max_body_bytes)]
    grpc_server = grpc.aio.server(options=options)
    grpc_server.add_generic_rpc_handlers((IngestServicer(gateway, settings, door).handler(),))
    address = f"{settings.bind_host}:{settings.grpc_port}"
    credentials = settings.grpc_credentials()
    bound = (
        grpc_server.add_secure_port(address, credentials)
        if credentials
        else grpc_server.add_insecure_port(address)
    )
    if bound == 0:
        raise RuntimeError(f"cannot bind gRPC to {address}")
    await grpc_server.start()

    _observe(gateway, door)
    beats = asyncio.create_task(
        heartbeat.beat_forever(redis, SERVICE, stack.instance, gateway.status)
    )
    recovery = asyncio.create_task(_recover_forever(stack, settings))
    log.info(
        "ingest listening: http %s:%d, grpc %s:%d",
        settings.bind_host,
        settings.http_port,
        settings.bind_host,
        settings.grpc_port,
    )
    return IngestServer(gateway, producer, redis, runner, grpc_server, beats, recovery, door)


def _observe(gateway: Gateway, door: Door) -> None:
    """The gateway's counters as OpenTelemetry (and so Prometheus) metrics."""
    meter = metrics.get_meter("rtrl.ingest")
    counters = gateway.counters
    otel.observe(
        meter,
        "rtrl.ingest.events",
        "counter",
        lambda: [(getattr(counters, f.name), {"outcome": f.name}) for f in fields(counters)],
        unit="{event}",
        description="Events answered, by outcome (privacy: counted, never published)",
    )
    otel.observe(
        meter,
        "rtrl.ingest.refused_requests",
        "counter",
        lambda: [(n, {"http_status": str(status)}) for status, n in door.refused.items()],
        unit="{request}",
        description="Requests refused before any event was looked at: 401 key, 403 scope, 429 rate limit",
    )
    otel.observe(
        meter,
        "rtrl.ingest.inflight",
        "gauge",
        lambda: [(gateway.inflight, {})],
        unit="{event}",
        description="Events claimed and not yet acked by the broker",
    )


async def _recover_forever(stack: StackSettings, settings: IngestSettings) -> None:
    """Settle events abandoned mid-produce by any gateway (ingest/recovery.py), now and
    every half claim TTL. A failed sweep is logged and tried again next time."""
    from rtrl.ingest.recovery import sweep

    while True:
        try:
            await _in_daemon_thread(
                sweep,
                stack,
                stack.redis_url,
                older_than_ms=settings.claim_ttl_s * 1000,
                dedup_ttl_s=settings.dedup_ttl_s,
            )
        except Exception:
            log.exception("recovery sweep failed")
        await asyncio.sleep(max(settings.claim_ttl_s / 2, 0.5))


async def _in_daemon_thread(function, *args, **kwargs):
    """``asyncio.to_thread`` on a daemon thread: a sweep still reading Kafka when the
    gateway stops must not hold the process (asyncio.run waits for its default executor)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(setter, value) -> None:
        if not future.done():
            setter(value)

    def run() -> None:
        try:
            result = function(*args, **kwargs)
        except BaseException as exc:
            outcome = (future.set_exception, exc)
        else:
            outcome = (future.set_result, result)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:
            pass  # the loop closed: nobody is waiting any more

    threading.Thread(target=run, name="ingest-recovery", daemon=True).start()
    return await future


async def serve(stack: StackSettings, settings: IngestSettings) -> None:
    """Run until SIGTERM or SIGINT, then drain."""
    server = await start(stack, settings)
    try:
        # A heartbeat that cannot reach Redis ends the process: the supervisor restarts it.
        await until_stopped(server.heartbeat_task)
    finally:
        await server.stop()


def main() -> None:
    settings, stack = entrypoint.parse_settings(
        "python -m rtrl.ingest", __doc__, IngestSettings, StackSettings
    )
    entrypoint.configure_logging()
    service_process()
    otel.configure(SERVICE, stack)
    asyncio.run(serve(stack, settings))
