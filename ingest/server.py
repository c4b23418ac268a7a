"""The ingest process: HTTP and gRPC front ends over one Gateway, plus its heartbeat.

Every request carries an API key (``Authorization: Bearer <key>``; gRPC metadata
``authorization``), checked against rtrl/api_keys.py before its body is looked at (on gRPC,
before its message is read: rtrl/grpc_limits.py, which also closes idle connections).

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
import logging
import threading
from dataclasses import dataclass, fields

import grpc
import redis.asyncio as aioredis
from aiohttp import web
from opentelemetry import metrics

from rtrl import entrypoint, heartbeat, kafka, otel, signing
from rtrl.admission import REFUSAL_STATUSES, Admission
from rtrl.api_keys import KeyCache, KeyVerifier, RateLimiter
from rtrl.config import StackSettings
from rtrl.grpc_limits import CredentialsCheck, CredentialsFirst
from rtrl.http_limits import serve_http
from rtrl.ingest.config import IngestSettings
from rtrl.ingest.gateway import Gateway
from rtrl.ingest.grpc_api import GRPC_CODE, IngestServicer
from rtrl.ingest.http_api import build_http_app
from rtrl.runtime import bounded, service_process, until_stopped

log = logging.getLogger("ingest")

SERVICE = "ingest"


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
    admission: Admission

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
    signer = _event_signer(settings)
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
    admission = _admission(stack, settings, redis)
    runner = await _serve_http(gateway, settings, admission)
    grpc_server = await _serve_grpc(gateway, settings, admission)
    _observe(gateway, admission)
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
    return IngestServer(gateway, producer, redis, runner, grpc_server, beats, recovery, admission)


def _event_signer(settings: IngestSettings) -> signing.Seal:
    """What authenticates every event written, a MAC for each reader (the joiner, the
    analytics sink); the gateway has no default key."""
    return signing.Seal(
        signing.MacSigner(settings.event_key.get_secret_value(), signing.Purpose.EVENT),
        signing.MacSigner(settings.analytics_event_key.get_secret_value(), signing.Purpose.EVENT),
    )


def _admission(stack: StackSettings, settings: IngestSettings, redis: aioredis.Redis) -> Admission:
    """API keys the operator signed and their rate limits; an open door only when
    RTRL_INGEST_AUTH_REQUIRED is off."""
    if not settings.auth_required:
        log.warning("RTRL_INGEST_AUTH_REQUIRED=false: accepting events without an API key")
        return Admission(None, None)
    verifier = KeyVerifier(signing.parse_public_keys(stack.api_key_public_keys))
    return Admission(
        KeyCache(redis, settings.key_cache_ttl_s, verifier),
        RateLimiter(redis),
        bytes_per_event=settings.key_bytes_per_event,
    )


async def _serve_http(
    gateway: Gateway, settings: IngestSettings, admission: Admission
) -> web.AppRunner:
    return await serve_http(
        build_http_app(gateway, settings, admission),
        settings.bind_host,
        settings.http_port,
        settings.http_limits(),
        settings.http_context(),
    )


async def _serve_grpc(
    gateway: Gateway, settings: IngestSettings, admission: Admission
) -> grpc.aio.Server:
    grpc_server = grpc.aio.server(
        options=settings.grpc_server_options(settings.max_body_bytes),
        interceptors=[CredentialsFirst(_grpc_credentials_check(admission))],
    )
    grpc_server.add_generic_rpc_handlers((IngestServicer(gateway, settings, admission).handler(),))
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
    return grpc_server


def _grpc_credentials_check(admission: Admission) -> CredentialsCheck:
    """The API key from a call's metadata, checked before its message is read: a keyless
    call is refused UNAUTHENTICATED without its message ever being held (rtrl/grpc_limits.py)."""

    async def check(metadata: dict[str, str]) -> tuple[grpc.StatusCode, str] | None:
        _, refusal = await admission.authenticate(metadata.get("authorization", ""))
        return None if refusal is None else (GRPC_CODE[refusal.status], refusal.message)

    return check


def _observe(gateway: Gateway, admission: Admission) -> None:
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
        lambda: [
            (admission.refused.get(status, 0), {"http_status": str(status)})
            for status in dict.fromkeys([*REFUSAL_STATUSES, *list(admission.refused)])
        ],
        unit="{request}",
        description="Requests refused before any event was looked at: 401 key, 403 scope, 429 rate limit",
    )
    otel.observe(
        meter,
        "rtrl.ingest.sdk_events",
        "counter",
        gateway.by_sdk.readings,
        unit="{event}",
        description="Events answered, by the SDK and version that sent them (X-Rtrl-Sdk) and "
        "outcome; unknown senders are sdk=other, versions past the first 32 sdk_version=other",
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
        "python -m rtrl.ingest",
        __doc__,
        IngestSettings,
        StackSettings,
        required=IngestSettings.required_secrets,
    )
    entrypoint.configure_logging()
    service_process()
    otel.configure(SERVICE, stack)
    asyncio.run(serve(stack, settings))
