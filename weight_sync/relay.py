"""A relay: follows weight_sync (or another relay) and serves the same Subscribe and
Latest to the workers near it, so a fleet's fan-out does not multiply the
publisher's egress. Run as ``python -m rtrl.weight_sync.relay`` (reads RTRL_* and
RTRL_WEIGHT_SYNC_RELAY_* variables).

A relay never decodes weights: it keeps each arm's blobs from the newest keyframes
on, exactly as received and checksum-verified upstream, and refuses Publish. It
needs no Redis and no blob store, so relays can be stacked into a tree.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from opentelemetry import trace
from opentelemetry.util.types import AttributeValue
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from rtrl import entrypoint, otel
from rtrl.config import RequiredSecret, Settings, StackSettings
from rtrl.runtime import service_process, until_stopped
from rtrl.tls import TLSListener
from rtrl.v1 import weights_pb2
from rtrl.weight_sync.broadcast import Broadcaster, abort, add_to_server, observe_fanout
from rtrl.weight_sync.store import check_arm
from rtrl.weight_sync.stream import AsyncVersionStream

log = logging.getLogger("rtrl.weight_sync.relay")
_tracer = trace.get_tracer("rtrl.relay")


class RelaySettings(Settings, TLSListener):
    model_config = SettingsConfigDict(env_prefix="RTRL_WEIGHT_SYNC_RELAY_")

    upstream_addr: str = "127.0.0.1:50061"
    """gRPC address of the weight_sync server, or of a relay nearer to it."""

    arms: tuple[str, ...] = ("control", "treatment")
    """Arms to relay (JSON list in the environment: ``'["control","treatment"]'``)."""

    bind_host: str = "127.0.0.1"
    """Address the relay's gRPC server binds to (``0.0.0.0`` in a container)."""

    port: int = Field(50071, ge=0, le=65535)
    """gRPC port; 0 picks a free one (tests)."""

    chunk_bytes: int = Field(1 << 20, ge=4096, le=3 << 20)
    """Blob bytes per WeightChunk sent downstream."""

    keep_keyframes: int = Field(2, ge=1)
    """Keyframes kept per arm, with the deltas after the oldest of them: what a worker
    arriving late or holding an older version can still be served from here."""

    poll_interval_s: float = Field(0.5, gt=0, le=10)
    """Following streams re-check for new versions this often (a wake-up also comes with each version)."""

    blob_cache_bytes: int = Field(64 << 20, ge=0)
    """Verified-blob cache of the broadcaster (the relay's own store already holds whole blobs)."""

    def __init__(self, **values) -> None:
        super().__init__(**values)
        for arm in self.arms:
            check_arm(arm)

    def required_secrets(self, stack: StackSettings) -> list[RequiredSecret]:
        """What ``python -m rtrl.weight_sync.relay`` does not start without."""
        return [
            RequiredSecret(
                stack,
                "weight_sync_subscribe_token",
                "the relay follows its upstream with it and asks it of its own subscribers",
            )
        ]


class RelayCache:
    """The VersionSource of a relay: per arm, the versions received upstream from the
    newest keep_keyframes keyframes on. Written only from the event loop."""

    def __init__(self, keep_keyframes: int) -> None:
        self.keep_keyframes = keep_keyframes
        self._versions: dict[str, dict[int, tuple[weights_pb2.Manifest, bytes]]] = {}

    def add(self, manifest: weights_pb2.Manifest, blob: bytes) -> None:
        versions = self._versions.setdefault(manifest.arm, {})
        versions[manifest.version] = (manifest, blob)
        keyframes = sorted(v for v, (m, _) in versions.items() if m.keyframe)
        if len(keyframes) > self.keep_keyframes:
            oldest_kept = keyframes[-self.keep_keyframes]
            for version in [v for v in versions if v < oldest_kept]:
                del versions[version]

    def held(self, arm: str) -> int:
        versions = self._versions.get(arm)
        return max(versions) if versions else -1

    async def latest(self, arm: str) -> int:
        return self.held(arm)

    async def newest_keyframe(self, arm: str, at_most: int) -> int | None:
        keyframes = [
            v for v, (m, _) in self._versions.get(arm, {}).items() if m.keyframe and v <= at_most
        ]
        return max(keyframes) if keyframes else None

    async def manifests(self, arm: str, first: int, last: int) -> dict[int, weights_pb2.Manifest]:
        return {v: m for v, (m, _) in self._versions.get(arm, {}).items() if first <= v <= last}

    async def blob(self, manifest: weights_pb2.Manifest) -> bytes | None:
        found = self._versions.get(manifest.arm, {}).get(manifest.version)
        return None if found is None else found[1]

    def published(self, arm: str, version: int) -> None:
        """Nothing cached to forget: add() already holds the new version."""


class RelayService(Broadcaster):
    async def Publish(self, request_iterator, context) -> weights_pb2.PublishResponse:
        await abort(
            context,
            grpc.StatusCode.PERMISSION_DENIED,
            "this is a relay: publish to the weight_sync server",
        )


class Relay:
    """The relay's gRPC server and one upstream follower thread per arm."""

    def __init__(self, settings: RelaySettings, stack: StackSettings) -> None:
        self.settings = settings
        token = stack.weight_sync_subscribe_token.get_secret_value()
        self.cache = RelayCache(settings.keep_keyframes)
        self.service = RelayService(
            self.cache,
            subscribe_tokens=(token,),
            chunk_bytes=settings.chunk_bytes,
            poll_interval_s=settings.poll_interval_s,
            blob_cache_bytes=settings.blob_cache_bytes,
        )
        self.streams = {
            arm: AsyncVersionStream(
                settings.upstream_addr,
                arm,
                f"relay-{stack.instance}",
                token,
                tls_ca_file=stack.weight_sync_tls_ca_file,
            )
            for arm in settings.arms
        }
        self._server = grpc.aio.server()
        add_to_server(self.service, self._server)
        self.tasks: list[asyncio.Task] = []
        self.port = settings.port

    async def start(self) -> int:
        address = f"{self.settings.bind_host}:{self.settings.port}"
        credentials = self.settings.grpc_credentials()
        self.port = (
            self._server.add_secure_port(address, credentials)
            if credentials
            else self._server.add_insecure_port(address)
        )
        if self.port == 0:
            raise RuntimeError(f"cannot bind {self.settings.bind_host}:{self.settings.port}")
        await self._server.start()
        observe_fanout("rtrl.relay", self.service)
        # A follower that fails for good (a wrong token, say) ends its task, and the relay with it.
        self.tasks = [
            asyncio.create_task(self._follow(arm, stream)) for arm, stream in self.streams.items()
        ]
        log.info(
            "relay of %s listening on %s:%d",
            self.settings.upstream_addr,
            self.settings.bind_host,
            self.port,
        )
        return self.port

    async def stop(self, grace_s: float = 0.5) -> None:
        for stream in self.streams.values():
            stream.stop()
        await self._server.stop(grace_s)
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=5)

    async def _follow(self, arm: str, stream: AsyncVersionStream) -> None:
        held = -1
        async for manifest, blob in stream.follow(held):
            if not manifest.keyframe and manifest.parent_version != held:
                log.error(
                    "relay: %s v%d is a delta on v%d but the relay holds v%d; starting over from a keyframe",
                    arm,
                    manifest.version,
                    manifest.parent_version,
                    held,
                )
                stream.reject()
                held = -1
                continue
            held = manifest.version
            stream.accept(held)
            # A span in the version's trace (a child of its weight_sync commit): which
            # relays a version passed through on its way to the workers.
            attributes: dict[str, AttributeValue] = {
                "rtrl.arm": arm,
                "rtrl.policy.version": held,
                "rtrl.relay.upstream": self.settings.upstream_addr,
            }
            _tracer.start_span(
                "weights relay", context=otel.parent(manifest.traceparent), attributes=attributes
            ).end()
            self.cache.add(manifest, blob)
            self.service.verified(manifest, blob)
            self.service.published(manifest.arm, manifest.version)

    def status(self) -> dict:
        return {
            "port": self.port,
            "upstream": self.settings.upstream_addr,
            "held": {arm: self.cache.held(arm) for arm in self.streams},
            "subscribers": self.service.subscribers,
            "bytes_sent": self.service.bytes_sent,
            "bytes_received": sum(s.bytes_received for s in self.streams.values()),
        }


async def serve(settings: RelaySettings, stack: StackSettings) -> None:
    relay = Relay(settings, stack)
    await relay.start()
    try:
        await until_stopped(*relay.tasks)
    finally:
        log.info("relay stopping: %s", relay.status())
        await relay.stop()


def main() -> None:
    settings, stack = entrypoint.parse_settings(
        "python -m rtrl.weight_sync.relay",
        __doc__,
        RelaySettings,
        StackSettings,
        required=RelaySettings.required_secrets,
    )
    entrypoint.configure_logging()
    service_process()
    otel.configure("relay", stack)
    asyncio.run(serve(settings, stack))


if __name__ == "__main__":
    main()
