"""The weight_sync server's rtrl.v1.WeightSync: accepts versions from the trainer
(Publish) and streams them to inference workers and relays (Subscribe, from
broadcast.py). Blobs go to the blob store, manifests to the blob store beside them
and then to the Redis registry.
server.py runs it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import NamedTuple

import grpc
from opentelemetry import trace

from rtrl import otel
from rtrl.v1 import weights_pb2
from rtrl.weight_sync import lineage
from rtrl.weight_sync.broadcast import Broadcaster, abort, retrieve_exception, valid_arm
from rtrl.weight_sync.checksum import xxh3_hex
from rtrl.weight_sync.config import WeightSyncSettings
from rtrl.weight_sync.recovery import stored_manifest
from rtrl.weight_sync.registry import Registry
from rtrl.weight_sync.store import BlobSizeMismatch, BlobStore

log = logging.getLogger("weight_sync")
_tracer = trace.get_tracer("rtrl.weight_sync")


class _Head(NamedTuple):
    """An arm's head as read from Redis (or known from this server's own commit)."""

    generation: int
    read_at: float
    latest: int
    newest_keyframe: int | None


class RegistrySource:
    """The VersionSource of the weight_sync server: manifests in Redis, blobs in the store.

    When a version is published every following stream wakes at once; they share one
    read of the arm's head (latest version and newest keyframe) and the manifests,
    which never change once committed, instead of each asking Redis. A head is
    re-read when a publish is announced, and at least every ``head_max_age_s`` in
    case an announcement was missed.
    """

    def __init__(
        self, registry: Registry, store: BlobStore, head_max_age_s: float, max_manifests: int = 4096
    ) -> None:
        self.registry = registry
        self.store = store
        self._head_max_age_s = head_max_age_s
        self._max_manifests = max_manifests
        self._generation: dict[str, int] = {}
        self._heads: dict[str, _Head] = {}
        self._reading: dict[str, tuple[int, asyncio.Task]] = {}
        self._manifests: OrderedDict[tuple[str, int], weights_pb2.Manifest] = OrderedDict()

    def published(self, arm: str, version: int) -> None:
        cached = self._heads.get(arm)
        if cached is None or cached.latest < version:
            self._generation[arm] = self._generation.get(arm, 0) + 1

    def head_disputed(self, arm: str) -> None:
        """The registry disagreed with what this server believed (a publish on top of
        the cached head was refused): read the head again before answering from it."""
        self._generation[arm] = self._generation.get(arm, 0) + 1

    def committed(self, manifest: weights_pb2.Manifest) -> None:
        """This server just committed ``manifest``: its head and manifest are known without asking Redis."""
        arm = manifest.arm
        cached = self._heads.get(arm)
        newest_keyframe = (
            manifest.version
            if manifest.keyframe
            else (None if cached is None else cached.newest_keyframe)
        )
        if manifest.keyframe or (cached is not None and cached.latest == manifest.version - 1):
            generation = self._generation.get(arm, 0) + 1
            self._generation[arm] = generation
            self._heads[arm] = _Head(
                generation, time.monotonic(), manifest.version, newest_keyframe
            )
        else:
            self.published(arm, manifest.version)
        self._manifests[(arm, manifest.version)] = manifest

    async def _head(self, arm: str) -> tuple[int, int | None]:
        generation = self._generation.get(arm, 0)
        cached = self._heads.get(arm)
        if (
            cached is not None
            and cached.generation == generation
            and time.monotonic() - cached.read_at < self._head_max_age_s
        ):
            return cached.latest, cached.newest_keyframe
        reading = self._reading.get(arm)
        # A read that began before the latest announcement may miss that version, and a
        # finished one is the head that just aged out: start another.
        if reading is None or reading[0] != generation or reading[1].done():
            reading = (generation, asyncio.create_task(self._read_head(arm, generation)))
            reading[1].add_done_callback(retrieve_exception)
            self._reading[arm] = reading
        return await asyncio.shield(reading[1])

    async def _read_head(self, arm: str, generation: int) -> tuple[int, int | None]:
        read_at = time.monotonic()
        latest = await self.registry.latest(arm)
        newest_keyframe = await self.registry.newest_keyframe(arm, latest)
        cached = self._heads.get(arm)
        if cached is not None and latest < cached.latest:
            # The registry went back (flushed, or restored from an older copy): version
            # numbers are being reused, so what was cached under them no longer holds.
            log.warning(
                "registry of %s went back from v%d to v%d; dropping cached manifests",
                arm,
                cached.latest,
                latest,
            )
            for key in [key for key in self._manifests if key[0] == arm]:
                del self._manifests[key]
        if self._generation.get(arm, 0) == generation:
            self._heads[arm] = _Head(generation, read_at, latest, newest_keyframe)
        return latest, newest_keyframe

    async def latest(self, arm: str) -> int:
        return (await self._head(arm))[0]

    async def newest_keyframe(self, arm: str, at_most: int) -> int | None:
        latest, newest_keyframe = await self._head(arm)
        if at_most >= latest and (newest_keyframe is None or newest_keyframe <= at_most):
            return newest_keyframe
        return await self.registry.newest_keyframe(arm, at_most)

    async def manifests(self, arm: str, first: int, last: int) -> dict[int, weights_pb2.Manifest]:
        found = {
            v: m for v in range(first, last + 1) if (m := self._manifests.get((arm, v))) is not None
        }
        missing = [v for v in range(first, last + 1) if v not in found]
        if missing:
            fetched = await self.registry.manifests(arm, missing[0], missing[-1])
            for version, manifest in fetched.items():
                self._manifests[(arm, version)] = manifest
                found.setdefault(version, manifest)
            while len(self._manifests) > self._max_manifests:
                self._manifests.popitem(last=False)
        return found

    async def blob(self, manifest: weights_pb2.Manifest) -> bytes | None:
        try:
            return await asyncio.to_thread(self.store.read, manifest.blob_uri, manifest.blob_size)
        except FileNotFoundError:
            return None
        except BlobSizeMismatch as exc:
            log.error("blob of %s v%d refused unread: %s", manifest.arm, manifest.version, exc)
            return None


class WeightSyncService(Broadcaster):
    """Publish for the holder of the publish token (the trainer); Subscribe and Latest
    for holders of the subscribe token (workers, relays) or the publish token."""

    def __init__(
        self,
        settings: WeightSyncSettings,
        token: str,
        subscribe_token: str,
        registry: Registry,
        store: BlobStore,
    ) -> None:
        self._registry_source = RegistrySource(
            registry, store, head_max_age_s=settings.poll_interval_s / 2
        )
        super().__init__(
            self._registry_source,
            subscribe_tokens=(subscribe_token, token),
            chunk_bytes=settings.chunk_bytes,
            poll_interval_s=settings.poll_interval_s,
            blob_cache_bytes=settings.blob_cache_bytes,
        )
        self._settings = settings
        self._publish_bearer = (f"Bearer {token}".encode(),)
        self._registry = registry
        self._store = store
        self._publish_locks: dict[str, asyncio.Lock] = {}
        self.versions_published = 0
        self.latest: dict[str, int] = {}
        """The newest version this server committed, per arm."""

    async def Latest(
        self, request: weights_pb2.LatestRequest, context
    ) -> weights_pb2.LatestResponse:
        """Read from the registry itself, not the shared cached head: a publisher's next
        parent_version comes from here, and after a rebuild by another server the cached
        head may still name a version the registry no longer holds."""
        await self._authorize(context, self._bearers, "reading versions")
        arm = await valid_arm(request.arm, context)
        return weights_pb2.LatestResponse(version=await self._registry.latest(arm))

    async def Publish(
        self, request_iterator: AsyncIterator[weights_pb2.PublishChunk], context
    ) -> weights_pb2.PublishResponse:
        await self._authorize(context, self._publish_bearer, "publishing")
        manifest: weights_pb2.Manifest | None = None
        parts: list[bytes] = []
        received = 0
        async for chunk in request_iterator:
            if manifest is None:
                if not chunk.HasField("manifest"):
                    await abort(
                        context,
                        grpc.StatusCode.INVALID_ARGUMENT,
                        "the first PublishChunk must carry the manifest",
                    )
                manifest = weights_pb2.Manifest()
                manifest.CopyFrom(chunk.manifest)
                if manifest.blob_size > self._settings.max_blob_bytes:
                    await abort(
                        context,
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"the manifest declares {manifest.blob_size} bytes, "
                        f"more than max_blob_bytes {self._settings.max_blob_bytes}",
                    )
            # The declared size is enforced as the stream arrives, not after buffering it.
            received += len(chunk.data)
            if received > manifest.blob_size:
                await abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"the stream carries more than the {manifest.blob_size} bytes its manifest declares",
                )
            parts.append(chunk.data)
        if manifest is None:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "empty publish")
        arm = await valid_arm(manifest.arm, context)
        with _tracer.start_as_current_span(
            "weights commit",
            context=otel.parent(manifest.traceparent),
            kind=trace.SpanKind.SERVER,
            attributes={
                "rpc.system": "grpc",
                "rpc.method": "rtrl.v1.WeightSync/Publish",
                "rtrl.arm": arm,
            },
        ) as span:
            await self._commit(manifest, b"".join(parts), context, span)
        return weights_pb2.PublishResponse(version=manifest.version)

    async def _commit(
        self, manifest: weights_pb2.Manifest, blob: bytes, context, span: trace.Span
    ) -> None:
        """Store the blob, then commit the manifest as the arm's next version (the
        registry's compare-and-set decides between concurrent publishers). The stored
        manifest carries this span's traceparent: each worker's apply span is its child."""
        arm = manifest.arm
        if len(blob) != manifest.blob_size or xxh3_hex(blob) != manifest.blob_checksum:
            await abort(
                context,
                grpc.StatusCode.DATA_LOSS,
                f"received {len(blob)} bytes hashing to {xxh3_hex(blob)}; "
                f"manifest says {manifest.blob_size} bytes, {manifest.blob_checksum}",
            )
        async with self._publish_locks.setdefault(arm, asyncio.Lock()):
            latest, next_version = await self._next_version(manifest, context)
            _stamp(manifest, next_version, span)
            manifest.blob_uri = await asyncio.to_thread(
                self._store.write, arm, manifest.version, blob
            )
            # Durable beside its blob before the commit: a committed version can always be rebuilt.
            await asyncio.to_thread(
                self._store.write_manifest, arm, manifest.version, stored_manifest(manifest)
            )
            if not await self._registry.commit(manifest, expected_latest=latest):
                self._registry_source.head_disputed(arm)
                await abort(
                    context,
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"another publisher committed version {manifest.version} of arm {arm!r} first",
                )
        self._announce(manifest, blob)

    async def _next_version(self, manifest: weights_pb2.Manifest, context) -> tuple[int, int]:
        """The arm's latest version and the one this publish becomes; aborts the call
        (FAILED_PRECONDITION) when the manifest does not continue the arm's lineage."""
        arm = manifest.arm
        latest = await self._registry.latest(arm)
        next_version = await self._registry.next_version(arm, latest)
        problem = lineage.publish_problem(
            manifest,
            latest,
            await self._registry.newest_keyframe(arm, latest),
            self._settings.keyframe_every,
            next_version,
        )
        if problem:
            self._registry_source.head_disputed(arm)
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, problem)
        return latest, next_version

    def _announce(self, manifest: weights_pb2.Manifest, blob: bytes) -> None:
        """A committed version: to the cached head, the following streams and the counters."""
        arm = manifest.arm
        self._registry_source.committed(manifest)
        self.verified(manifest, blob)
        self.published(arm, manifest.version)
        self.versions_published += 1
        self.latest[arm] = max(self.latest.get(arm, -1), manifest.version)
        log.info(
            "published %s v%d (%s, %d bytes)",
            arm,
            manifest.version,
            "keyframe" if manifest.keyframe else "delta",
            len(blob),
        )


def _stamp(manifest: weights_pb2.Manifest, version: int, span: trace.Span) -> None:
    """What the server decides of a manifest it commits: its version, a keyframe's
    parent, its creation time and the trace it continues."""
    manifest.version = version
    if manifest.keyframe:
        # In a publish, parent_version is the compare-and-set token; stored keyframes say -1.
        manifest.parent_version = -1
    manifest.created_ts_ms = int(time.time() * 1000)
    manifest.traceparent = otel.traceparent_of(span) or manifest.traceparent
    span.set_attributes(
        {
            "rtrl.policy.version": manifest.version,
            "rtrl.weights.keyframe": manifest.keyframe,
        }
    )
