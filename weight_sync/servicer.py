"""The servicer of rtrl.v1.WeightSync: accepts versions from the trainer and streams
them to inference workers. It only moves bytes: what a blob contains is codec.py's
business, which versions to send is lineage.py's. server.py runs it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Iterator

import grpc

from rtrl.v1 import weights_pb2, weights_pb2_grpc
from weight_sync import lineage
from weight_sync.checksum import xxh3_hex
from weight_sync.config import WeightSyncSettings
from weight_sync.registry import Registry
from weight_sync.store import BlobStore, check_arm

log = logging.getLogger("weight_sync")


def version_chunks(manifest: weights_pb2.Manifest, blob: bytes, chunk_bytes: int) -> Iterator[weights_pb2.WeightChunk]:
    """One version as WeightChunks: the first carries the manifest, the final one has last=True."""
    for offset in range(0, max(len(blob), 1), chunk_bytes):
        chunk = weights_pb2.WeightChunk(
            version=manifest.version,
            offset=offset,
            data=blob[offset : offset + chunk_bytes],
            last=offset + chunk_bytes >= len(blob),
        )
        if offset == 0:
            chunk.manifest.CopyFrom(manifest)
        yield chunk


class PublishedSignal:
    """Wakes the Subscribe streams of an arm when a version of it is published."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}

    def notify(self, arm: str) -> None:
        event = self._events.pop(arm, None)
        if event is not None:
            event.set()

    async def wait(self, arm: str, timeout_s: float) -> None:
        event = self._events.setdefault(arm, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            pass


class WeightSyncService(weights_pb2_grpc.WeightSyncServicer):
    def __init__(self, settings: WeightSyncSettings, token: str, registry: Registry, store: BlobStore) -> None:
        self._settings = settings
        self._bearer = f"Bearer {token}".encode()
        self._registry = registry
        self._store = store
        self._publish_locks: dict[str, asyncio.Lock] = {}
        self.signal = PublishedSignal()
        self.subscribers = 0
        self.bytes_sent = 0
        self.versions_published = 0

    async def Latest(self, request: weights_pb2.LatestRequest, context) -> weights_pb2.LatestResponse:
        arm = await _valid_arm(request.arm, context)
        return weights_pb2.LatestResponse(version=await self._registry.latest(arm))

    async def Publish(self, request_iterator: AsyncIterator[weights_pb2.PublishChunk], context) -> weights_pb2.PublishResponse:
        supplied = dict(context.invocation_metadata()).get("authorization", "")
        if not hmac.compare_digest(supplied.encode(), self._bearer):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "publishing needs metadata 'authorization: Bearer <weight_sync_token>'")
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
        arm = await _valid_arm(manifest.arm, context)
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

    async def Subscribe(self, request: weights_pb2.SubscribeRequest, context) -> AsyncIterator[weights_pb2.WeightChunk]:
        arm = await _valid_arm(request.arm, context)
        held = request.have_version
        log.info("subscriber %r on %s from v%d%s", request.worker_id, arm, held, " (follow)" if request.follow else "")
        self.subscribers += 1
        try:
            while True:
                latest = await self._registry.latest(arm)
                if latest >= 0 and held != latest:
                    async for chunk in self._path_chunks(arm, held, latest, context):
                        if chunk.last:
                            held = chunk.version
                        self.bytes_sent += len(chunk.data)
                        yield chunk
                if not request.follow:
                    return
                await self.signal.wait(arm, self._settings.poll_interval_s)
        finally:
            self.subscribers -= 1

    async def _path_chunks(self, arm: str, held: int, latest: int, context) -> AsyncIterator[weights_pb2.WeightChunk]:
        """Chunks of every version from held to latest; a version whose blob turns out
        missing or corrupt is never sent, and the path is planned again without it."""
        unusable: set[int] = set()
        while held != latest:
            newest_keyframe = await self._registry.newest_keyframe(arm, latest)
            first = newest_keyframe if newest_keyframe is not None else held + 1
            manifests = await self._registry.manifests(arm, max(first, 0), latest)
            available = {v: m for v, m in manifests.items() if v not in unusable and self._store.exists(m.blob_uri)}
            path = lineage.sync_path(held, latest, newest_keyframe, available)
            if path is None:
                await context.abort(
                    grpc.StatusCode.DATA_LOSS,
                    f"no intact path from {arm} v{held} to v{latest} (newest keyframe {newest_keyframe}, "
                    f"unusable {sorted(unusable)}); waiting for the next keyframe",
                )
            for version in path:
                blob = await asyncio.to_thread(self._verified_blob, available[version])
                if blob is None:
                    unusable.add(version)
                    break
                for chunk in version_chunks(available[version], blob, self._settings.chunk_bytes):
                    yield chunk
                held = version

    def _verified_blob(self, manifest: weights_pb2.Manifest) -> bytes | None:
        try:
            blob = self._store.read(manifest.blob_uri)
        except FileNotFoundError:
            log.error("blob of %s v%d is missing: %s", manifest.arm, manifest.version, manifest.blob_uri)
            return None
        if len(blob) != manifest.blob_size or xxh3_hex(blob) != manifest.blob_checksum:
            log.error("blob of %s v%d is corrupt (checksum mismatch): %s", manifest.arm, manifest.version, manifest.blob_uri)
            return None
        return blob


async def _valid_arm(arm: str, context) -> str:
    try:
        return check_arm(arm)
    except ValueError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
