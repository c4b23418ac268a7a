"""The weight_sync server's rtrl.v1.WeightSync: accepts versions from the trainer
(Publish) and streams them to inference workers and relays (Subscribe, from
broadcast.py). Blobs go to the blob store, manifests to the Redis registry.
server.py runs it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from rtrl.v1 import weights_pb2
from weight_sync import lineage
from weight_sync.broadcast import Broadcaster, valid_arm
from weight_sync.checksum import xxh3_hex
from weight_sync.config import WeightSyncSettings
from weight_sync.registry import Registry
from weight_sync.store import BlobStore

log = logging.getLogger("weight_sync")


class RegistrySource:
    """The VersionSource of the weight_sync server: manifests in Redis, blobs in the store."""

    def __init__(self, registry: Registry, store: BlobStore) -> None:
        self.registry = registry
        self.store = store

    async def latest(self, arm: str) -> int:
        return await self.registry.latest(arm)

    async def newest_keyframe(self, arm: str, at_most: int) -> int | None:
        return await self.registry.newest_keyframe(arm, at_most)

    async def manifests(self, arm: str, first: int, last: int) -> dict[int, weights_pb2.Manifest]:
        return await self.registry.manifests(arm, first, last)

    async def blob(self, manifest: weights_pb2.Manifest) -> bytes | None:
        try:
            return await asyncio.to_thread(self.store.read, manifest.blob_uri)
        except FileNotFoundError:
            return None


class WeightSyncService(Broadcaster):
    """Publish for the holder of the publish token (the trainer); Subscribe and Latest
    for holders of the subscribe token (workers, relays) or the publish token."""

    def __init__(self, settings: WeightSyncSettings, token: str, subscribe_token: str, registry: Registry, store: BlobStore) -> None:
        super().__init__(
            RegistrySource(registry, store),
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

    async def Publish(self, request_iterator: AsyncIterator[weights_pb2.PublishChunk], context) -> weights_pb2.PublishResponse:
        await self._authorize(context, self._publish_bearer, "publishing")
        manifest: weights_pb2.Manifest | None = None
        parts: list[bytes] = []
        async for chunk in request_iterator:
            if manifest is None:
                if not chunk.HasField("manifest"):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first PublishChunk must carry the manifest")
                manifest = weights_pb2.Manifest()
                manifest.CopyFrom(chunk.manifest)
            parts.append(chunk.data)
        if manifest is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty publish")
        arm = await valid_arm(manifest.arm, context)
        blob = b"".join(parts)
        if len(blob) != manifest.blob_size or xxh3_hex(blob) != manifest.blob_checksum:
            await context.abort(
                grpc.StatusCode.DATA_LOSS,
                f"received {len(blob)} bytes hashing to {xxh3_hex(blob)}; manifest says {manifest.blob_size} bytes, {manifest.blob_checksum}",
            )
        async with self._publish_locks.setdefault(arm, asyncio.Lock()):
            latest = await self._registry.latest(arm)
            problem = lineage.publish_problem(
                manifest, latest, await self._registry.newest_keyframe(arm, latest), self._settings.keyframe_every
            )
            if problem:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
            manifest.version = latest + 1
            if manifest.keyframe:
                # In a publish, parent_version is the compare-and-set token; stored keyframes say -1.
                manifest.parent_version = -1
            manifest.created_ts_ms = int(time.time() * 1000)
            manifest.blob_uri = await asyncio.to_thread(self._store.write, arm, manifest.version, blob)
            if not await self._registry.commit(manifest):
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"another publisher committed version {manifest.version} of arm {arm!r} first")
        self.versions_published += 1
        log.info("published %s v%d (%s, %d bytes)", arm, manifest.version, "keyframe" if manifest.keyframe else "delta", len(blob))
        return weights_pb2.PublishResponse(version=manifest.version)
