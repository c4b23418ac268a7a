"""Streaming versions to subscribers: the Subscribe and Latest half of rtrl.v1.WeightSync.

A Broadcaster serves from a VersionSource: the registry and blob store on the
weight_sync server, or a relay's cache of what it received upstream. It only moves
bytes: what a blob contains is codec.py's business, which versions to send is
lineage.py's. Every blob it sends was checked against its manifest's checksum;
verified blobs are kept in a small cache, so eight subscribers of one version cost
one read and one hash.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from typing import Protocol

import grpc

from rtrl.v1 import weights_pb2, weights_pb2_grpc
from weight_sync import lineage
from weight_sync.checksum import xxh3_hex
from weight_sync.store import check_arm

log = logging.getLogger("weight_sync")


class VersionSource(Protocol):
    """What a Broadcaster serves from."""

    async def latest(self, arm: str) -> int: ...

    async def newest_keyframe(self, arm: str, at_most: int) -> int | None: ...

    async def manifests(self, arm: str, first: int, last: int) -> dict[int, weights_pb2.Manifest]: ...

    async def blob(self, manifest: weights_pb2.Manifest) -> bytes | None:
        """The blob's bytes, None if it is gone (unverified: the Broadcaster checks)."""
        ...


def version_chunks(manifest: weights_pb2.Manifest, blob: bytes, chunk_bytes: int, start: int = 0) -> Iterator[weights_pb2.WeightChunk]:
    """One version as WeightChunks from byte ``start``: the first carries the manifest, the final one has last=True."""
    for offset in range(start, max(len(blob), start + 1), chunk_bytes):
        chunk = weights_pb2.WeightChunk(
            version=manifest.version,
            offset=offset,
            data=blob[offset : offset + chunk_bytes],
            last=offset + chunk_bytes >= len(blob),
        )
        if offset == start:
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


class VerifiedBlobs:
    """An LRU of blobs that matched their manifests, bounded in bytes. Blobs are
    immutable once committed, so a hit needs no second check."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._blobs: OrderedDict[tuple[str, int, str], bytes] = OrderedDict()
        self._bytes = 0

    def get(self, manifest: weights_pb2.Manifest) -> bytes | None:
        key = (manifest.arm, manifest.version, manifest.blob_checksum)
        blob = self._blobs.get(key)
        if blob is not None:
            self._blobs.move_to_end(key)
        return blob

    def put(self, manifest: weights_pb2.Manifest, blob: bytes) -> None:
        if len(blob) > self.max_bytes:
            return
        key = (manifest.arm, manifest.version, manifest.blob_checksum)
        if key in self._blobs:
            return
        self._blobs[key] = blob
        self._bytes += len(blob)
        while self._bytes > self.max_bytes:
            _, evicted = self._blobs.popitem(last=False)
            self._bytes -= len(evicted)


class Broadcaster(weights_pb2_grpc.WeightSyncServicer):
    """Subscribe and Latest over a VersionSource, for holders of a subscribe token."""

    def __init__(
        self,
        source: VersionSource,
        *,
        subscribe_tokens: tuple[str, ...],
        chunk_bytes: int,
        poll_interval_s: float,
        blob_cache_bytes: int,
    ) -> None:
        self._source = source
        self._bearers = tuple(f"Bearer {token}".encode() for token in subscribe_tokens)
        self._chunk_bytes = chunk_bytes
        self._poll_interval_s = poll_interval_s
        self._verified = VerifiedBlobs(blob_cache_bytes)
        self.signal = PublishedSignal()
        self.subscribers = 0
        self.bytes_sent = 0
        self.versions_sent = 0
        self.resumed = 0

    async def Latest(self, request: weights_pb2.LatestRequest, context) -> weights_pb2.LatestResponse:
        await self._authorize(context, self._bearers, "reading versions")
        arm = await valid_arm(request.arm, context)
        return weights_pb2.LatestResponse(version=await self._source.latest(arm))

    async def Subscribe(self, request: weights_pb2.SubscribeRequest, context) -> AsyncIterator[weights_pb2.WeightChunk]:
        await self._authorize(context, self._bearers, "subscribing")
        arm = await valid_arm(request.arm, context)
        held = request.have_version
        resume = request.resume if request.HasField("resume") else None
        log.info(
            "subscriber %r on %s from v%d%s%s",
            request.worker_id,
            arm,
            held,
            f", resuming v{resume.version} at byte {resume.offset}" if resume else "",
            " (follow)" if request.follow else "",
        )
        self.subscribers += 1
        try:
            while True:
                latest = await self._source.latest(arm)
                if latest >= 0 and held != latest:
                    async for chunk in self._path_chunks(arm, held, latest, resume, context):
                        resume = None
                        if chunk.last:
                            held = chunk.version
                            self.versions_sent += 1
                        self.bytes_sent += len(chunk.data)
                        yield chunk
                if not request.follow:
                    return
                await self.signal.wait(arm, self._poll_interval_s)
        finally:
            self.subscribers -= 1

    async def _path_chunks(
        self, arm: str, held: int, latest: int, resume: weights_pb2.Resume | None, context
    ) -> AsyncIterator[weights_pb2.WeightChunk]:
        """Chunks of every version from held to latest; a version whose blob turns out
        missing or corrupt is never sent, and the path is planned again without it."""
        unusable: set[int] = set()
        while held != latest:
            newest_keyframe = await self._source.newest_keyframe(arm, latest)
            first = newest_keyframe if newest_keyframe is not None else held + 1
            candidates = await self._source.manifests(arm, max(first, 0), latest)
            available = {v: m for v, m in candidates.items() if v not in unusable}
            path = lineage.sync_path(held, latest, newest_keyframe, available)
            if path is None:
                await context.abort(
                    grpc.StatusCode.DATA_LOSS,
                    f"no intact path from {arm} v{held} to v{latest} (newest keyframe {newest_keyframe}, "
                    f"unusable {sorted(unusable)}); waiting for the next keyframe",
                )
            for version in path:
                manifest = available[version]
                blob = await self._verified_blob(manifest)
                if blob is None:
                    unusable.add(version)
                    break
                start = 0
                if resume is not None and resume.version == version and resume.blob_checksum == manifest.blob_checksum and resume.offset < len(blob):
                    start = resume.offset
                    self.resumed += 1
                resume = None
                for chunk in version_chunks(manifest, blob, self._chunk_bytes, start):
                    yield chunk
                held = version

    async def _verified_blob(self, manifest: weights_pb2.Manifest) -> bytes | None:
        blob = self._verified.get(manifest)
        if blob is not None:
            return blob
        blob = await self._source.blob(manifest)
        if blob is None:
            log.error("blob of %s v%d is missing: %s", manifest.arm, manifest.version, manifest.blob_uri)
            return None
        if len(blob) != manifest.blob_size or await asyncio.to_thread(xxh3_hex, blob) != manifest.blob_checksum:
            log.error("blob of %s v%d is corrupt (checksum mismatch): %s", manifest.arm, manifest.version, manifest.blob_uri)
            return None
        self._verified.put(manifest, blob)
        return blob

    @staticmethod
    async def _authorize(context, bearers: tuple[bytes, ...], doing: str) -> None:
        supplied = dict(context.invocation_metadata()).get("authorization", "").encode()
        # compare_digest against every token, so the time taken does not say which one nearly matched.
        matches = [hmac.compare_digest(supplied, bearer) for bearer in bearers]
        if not any(matches):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{doing} needs metadata 'authorization: Bearer <token>' with a valid token")


async def valid_arm(arm: str, context) -> str:
    try:
        return check_arm(arm)
    except ValueError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
