"""The weight_sync process: the gRPC server, its pub/sub listener, its heartbeat, its
watch over the registry (rebuilt from the blob store when Redis lost it) and its
garbage collection of old versions.

Run as ``python -m rtrl.weight_sync`` (reads RTRL_* and RTRL_WEIGHT_SYNC_* variables);
tests run WeightSyncServer in-process.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import redis.asyncio as aioredis
from opentelemetry import metrics
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rtrl import entrypoint, heartbeat, otel
from rtrl.config import StackSettings
from rtrl.runtime import bounded, service_process, until_stopped
from rtrl.weight_sync import gc
from rtrl.weight_sync.broadcast import add_to_server, observe_fanout
from rtrl.weight_sync.config import WeightSyncSettings
from rtrl.weight_sync.recovery import RegistryRecovery
from rtrl.weight_sync.registry import PUBLISHED_PATTERN, Registry, arm_of_channel
from rtrl.weight_sync.servicer import WeightSyncService
from rtrl.weight_sync.store import open_store

log = logging.getLogger("weight_sync")
SERVICE = "weight_sync"
_REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, OSError)
MAX_MESSAGE_BYTES = 4 << 20
"""The largest message weight_sync takes: gRPC's default, a publish's chunks fit in it."""


class WeightSyncServer:
    def __init__(self, settings: WeightSyncSettings, stack: StackSettings) -> None:
        self.settings = settings
        self.stack = stack
        self.port = settings.port
        self._redis = aioredis.Redis.from_url(stack.redis_url)
        self.store = open_store(settings, stack)
        self.recovery = RegistryRecovery(Registry(self._redis), self.store)
        self.registry = Registry(self._redis, on_lost=self.recovery.ensure)
        self.service = WeightSyncService(
            settings,
            token=stack.weight_sync_token.get_secret_value(),
            subscribe_token=stack.weight_sync_subscribe_token.get_secret_value(),
            registry=self.registry,
            store=self.store,
        )
        # Idle connections closed and quiet ones pinged, as on every gRPC listener; no age
        # limit, which would cut the workers' long Subscribe streams. Messages stay within
        # gRPC's default 4 MiB (publishes arrive in chunks).
        self._server = grpc.aio.server(options=settings.grpc_server_options(MAX_MESSAGE_BYTES))
        add_to_server(self.service, self._server)
        self.tasks: list[asyncio.Task] = []
        self.versions_collected = 0

    async def start(self) -> int:
        """Listen and start the background loops; returns the bound port."""
        address = f"{self.settings.bind_host}:{self.settings.port}"
        credentials = self.settings.grpc_credentials()
        self.port = (
            self._server.add_secure_port(address, credentials)
            if credentials
            else self._server.add_insecure_port(address)
        )
        if self.port == 0:
            raise RuntimeError(f"cannot bind {self.settings.bind_host}:{self.settings.port}")
        # Before the first answer: a registry Redis lost while we were down comes back first.
        await self.recovery.ensure()
        await self._server.start()
        self.tasks = [
            asyncio.create_task(self._listen()),
            asyncio.create_task(self._heartbeat()),
            asyncio.create_task(self._watch_registry()),
        ]
        observe_fanout("rtrl.weight_sync", self.service)
        meter = metrics.get_meter("rtrl.weight_sync")
        otel.observe(
            meter,
            "rtrl.weight_sync.versions_published",
            "counter",
            lambda: [(self.service.versions_published, {})],
            unit="{version}",
            description="Versions committed by this server",
        )
        otel.observe(
            meter,
            "rtrl.weight_sync.latest_version",
            "gauge",
            lambda: [(v, {"arm": arm}) for arm, v in self.service.latest.items()],
            description="Newest version this server committed, per arm",
        )
        otel.observe(
            meter,
            "rtrl.weight_sync.registry_rebuilds",
            "counter",
            lambda: [(self.recovery.rebuilds, {})],
            unit="{rebuild}",
            description="Lost registries this server rebuilt from the blob store",
        )
        if self.settings.gc_interval_s > 0:
            self.tasks.append(asyncio.create_task(self._collect_garbage()))
        log.info(
            "weight_sync listening on %s:%d, blobs in %s",
            self.settings.bind_host,
            self.port,
            self.store.url,
        )
        return self.port

    async def stop(self, grace_s: float | None = None) -> None:
        # The background loops go first: a server on its way out must not rebuild a
        # registry (from its own blob store) that the servers staying up now own.
        # Following streams still poll through the grace period.
        # Each step is bounded (rtrl.runtime.bounded): a step that swallows its cancellation,
        # as a gRPC aio shutdown with a stream still open can, is abandoned, not waited on.
        for task in self.tasks:
            task.cancel()
        await bounded("background loops", asyncio.gather(*self.tasks, return_exceptions=True), 5)
        grace = self.settings.shutdown_grace_s if grace_s is None else grace_s
        await bounded("gRPC drain", self._server.stop(grace), grace + 5)
        await bounded("Redis close", self._redis.aclose(), 2)

    async def _listen(self) -> None:
        """Wake subscribers on every publish (of this or another server). Following
        streams also poll, so a gap while Redis reconnects only delays them."""
        while True:
            pubsub = self._redis.pubsub()
            try:
                await pubsub.psubscribe(PUBLISHED_PATTERN)
                async for message in pubsub.listen():
                    if message["type"] == "pmessage":
                        self.service.published(
                            arm_of_channel(message["channel"].decode()), int(message["data"])
                        )
            except _REDIS_DOWN as exc:
                log.warning("pub/sub listener lost Redis (%s); retrying in 1 s", exc)
                await asyncio.sleep(1.0)
            finally:
                await pubsub.aclose()

    async def _heartbeat(self) -> None:
        while True:
            try:
                await heartbeat.beat(self._redis, SERVICE, self.stack.instance, await self.status())
            except _REDIS_DOWN as exc:
                log.warning("heartbeat failed (%s)", exc)
            await asyncio.sleep(self.settings.heartbeat_interval_s)

    async def _watch_registry(self) -> None:
        """Notice a lost registry while nothing reads it (every read and commit checks too)."""
        unavailable: tuple[type[BaseException], ...] = (*_REDIS_DOWN, *self.store.unavailable)
        while True:
            await asyncio.sleep(self.settings.poll_interval_s)
            try:
                await self.recovery.ensure()
            except unavailable as exc:
                log.warning(
                    "registry check failed (%s: %s); next try in %.1f s",
                    type(exc).__name__,
                    exc,
                    self.settings.poll_interval_s,
                )

    async def _collect_garbage(self) -> None:
        """Every server of a registry may run this: collection is idempotent, and a stale
        view of the registry only makes it delete less."""
        unavailable: tuple[type[BaseException], ...] = (*_REDIS_DOWN, *self.store.unavailable)
        while True:
            await asyncio.sleep(self.settings.gc_interval_s)
            try:
                await self.collect_garbage()
            except unavailable as exc:
                log.warning(
                    "garbage collection failed (%s: %s); next try in %.0f s",
                    type(exc).__name__,
                    exc,
                    self.settings.gc_interval_s,
                )

    async def collect_garbage(self) -> list[gc.ArmPlan]:
        plans = await gc.collect(self.registry, self.store, self.settings.keep_keyframes)
        self.versions_collected += sum(len(p.versions) for p in plans)
        return plans

    async def status(self) -> heartbeat.WeightSyncBeat:
        return heartbeat.WeightSyncBeat(
            port=self.port,
            latest=await self.registry.latest_by_arm(),
            subscribers=self.service.subscribers,
            bytes_sent=self.service.bytes_sent,
            versions_published=self.service.versions_published,
            versions_collected=self.versions_collected,
            registry_rebuilds=self.recovery.rebuilds,
            last_registry_rebuild=self.recovery.last_rebuild,
        )


async def serve(settings: WeightSyncSettings, stack: StackSettings) -> None:
    """Run until SIGTERM/SIGINT; a background loop that dies takes the process with it."""
    server = WeightSyncServer(settings, stack)
    await server.start()
    try:
        await until_stopped(*server.tasks)
    finally:
        log.info("weight_sync stopping")
        await server.stop()


def main() -> None:
    settings, stack = entrypoint.parse_settings(
        "python -m rtrl.weight_sync",
        __doc__,
        WeightSyncSettings,
        StackSettings,
        required=WeightSyncSettings.required_secrets,
    )
    entrypoint.configure_logging()
    service_process()
    otel.configure("weight_sync", stack)
    asyncio.run(serve(settings, stack))
