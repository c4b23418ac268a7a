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
from dataclasses import dataclass
from typing import NoReturn, Protocol

import grpc
from opentelemetry import metrics

from rtrl import otel
from rtrl.v1 import weights_pb2, weights_pb2_grpc
from rtrl.weight_sync import lineage
from rtrl.weight_sync.checksum import xxh3_hex
from rtrl.weight_sync.store import check_arm

log = logging.getLogger("weight_sync")


def retrieve_exception(task: asyncio.Task) -> None:
    """Mark a shared task's failure as seen: every awaiter gets it through shield(), but
    if all of them were cancelled first, asyncio would log it as never retrieved."""
    if not task.cancelled():
        task.exception()


async def abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    """End the RPC with ``code``: ``context.abort``, which always raises, typed as such
    (grpc ships no types), so the code after a call is checked as unreachable."""
    await context.abort(code, details)
    raise AssertionError("grpc's ServicerContext.abort returned")


class VersionSource(Protocol):
    """What a Broadcaster serves from."""

    async def latest(self, arm: str) -> int: ...

    async def newest_keyframe(self, arm: str, at_most: int) -> int | None: ...

    async def manifests(
        self, arm: str, first: int, last: int
    ) -> dict[int, weights_pb2.Manifest]: ...

    async def blob(self, manifest: weights_pb2.Manifest) -> bytes | None:
        """The blob's bytes, None if it is gone (unverified: the Broadcaster checks)."""
        ...

    def published(self, arm: str, version: int) -> None:
        """Version ``version`` of the arm was committed: forget any older view of its head."""
        ...


def version_chunks(
    manifest: weights_pb2.Manifest, blob: bytes, chunk_bytes: int, start: int = 0
) -> Iterator[weights_pb2.WeightChunk]:
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


@dataclass(frozen=True)
class Frame:
    """A serialized WeightChunk, sent as the same bytes to every subscriber."""

    wire: bytes
    version: int
    data_bytes: int
    last: bool


def frames(
    manifest: weights_pb2.Manifest, blob: bytes, chunk_bytes: int, start: int = 0
) -> list[Frame]:
    return [
        Frame(c.SerializeToString(), c.version, len(c.data), c.last)
        for c in version_chunks(manifest, blob, chunk_bytes, start)
    ]


def add_to_server(service: weights_pb2_grpc.WeightSyncServicer, server) -> None:
    """Register ``service`` like the generated add_WeightSyncServicer_to_server, except
    that Subscribe yields Frames: a version is serialized once, not once per subscriber."""
    handlers = {
        "Subscribe": grpc.unary_stream_rpc_method_handler(
            service.Subscribe,
            request_deserializer=weights_pb2.SubscribeRequest.FromString,
            response_serializer=lambda frame: frame.wire,
        ),
        "Publish": grpc.stream_unary_rpc_method_handler(
            service.Publish,
            request_deserializer=weights_pb2.PublishChunk.FromString,
            response_serializer=weights_pb2.PublishResponse.SerializeToString,
        ),
        "Latest": grpc.unary_unary_rpc_method_handler(
            service.Latest,
            request_deserializer=weights_pb2.LatestRequest.FromString,
            response_serializer=weights_pb2.LatestResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("rtrl.v1.WeightSync", handlers),)
    )
    server.add_registered_method_handlers("rtrl.v1.WeightSync", handlers)


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


@dataclass(frozen=True)
class VerifiedVersion:
    blob: bytes
    frames: list[Frame]
    """The whole version as sent from offset 0."""


class VerifiedVersions:
    """An LRU of versions whose blobs matched their manifests, with their serialized
    chunks, bounded in bytes. Blobs are immutable once committed, so a hit needs no
    second check."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._versions: OrderedDict[tuple[str, int, str], VerifiedVersion] = OrderedDict()
        self._bytes = 0

    def get(self, manifest: weights_pb2.Manifest) -> VerifiedVersion | None:
        key = (manifest.arm, manifest.version, manifest.blob_checksum)
        found = self._versions.get(key)
        if found is not None:
            self._versions.move_to_end(key)
        return found

    def put(self, manifest: weights_pb2.Manifest, version: VerifiedVersion) -> None:
        size = 2 * len(version.blob)
        key = (manifest.arm, manifest.version, manifest.blob_checksum)
        if size > self.max_bytes or key in self._versions:
            return
        self._versions[key] = version
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, evicted = self._versions.popitem(last=False)
            self._bytes -= 2 * len(evicted.blob)


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
        if not all(subscribe_tokens):
            raise ValueError(
                "a weight_sync listener needs its tokens "
                "(RTRL_WEIGHT_SYNC_TOKEN, RTRL_WEIGHT_SYNC_SUBSCRIBE_TOKEN): there are no defaults"
            )
        self._bearers = tuple(f"Bearer {token}".encode() for token in subscribe_tokens)
        self._chunk_bytes = chunk_bytes
        self._poll_interval_s = poll_interval_s
        self._verified = VerifiedVersions(blob_cache_bytes)
        self._loading: dict[tuple[str, int, str], asyncio.Task] = {}
        self.signal = PublishedSignal()
        self.subscribers = 0
        self.bytes_sent = 0
        self.versions_sent = 0
        self.resumed = 0

    def published(self, arm: str, version: int) -> None:
        """Called on every new version of ``arm``: refresh the source's view, wake the streams."""
        self._source.published(arm, version)
        self.signal.notify(arm)

    def verified(self, manifest: weights_pb2.Manifest, blob: bytes) -> None:
        """Cache a version whose blob the caller has just checked against its manifest
        (a publish), so its subscribers are served without reading it back."""
        self._verified.put(
            manifest, VerifiedVersion(blob, frames(manifest, blob, self._chunk_bytes))
        )

    async def Latest(
        self, request: weights_pb2.LatestRequest, context
    ) -> weights_pb2.LatestResponse:
        await self._authorize(context, self._bearers, "reading versions")
        arm = await valid_arm(request.arm, context)
        return weights_pb2.LatestResponse(version=await self._source.latest(arm))

    async def Subscribe(
        self, request: weights_pb2.SubscribeRequest, context
    ) -> AsyncIterator[Frame]:
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
                    async for frame in self._path_frames(arm, held, latest, resume, context):
                        resume = None
                        if frame.last:
                            held = frame.version
                            self.versions_sent += 1
                        self.bytes_sent += frame.data_bytes
                        yield frame
                if not request.follow:
                    return
                await self.signal.wait(arm, self._poll_interval_s)
        finally:
            self.subscribers -= 1

    async def _path_frames(
        self, arm: str, held: int, latest: int, resume: weights_pb2.Resume | None, context
    ) -> AsyncIterator[Frame]:
        """Chunks of every version from held to latest; a version whose blob turns out
        missing or corrupt is never sent, and the path is planned again without it."""
        unusable: set[int] = set()
        while held != latest:
            newest_keyframe = await self._source.newest_keyframe(arm, latest)
            first = newest_keyframe if newest_keyframe is not None else held + 1
            candidates = await self._source.manifests(arm, max(first, 0), latest)
            available = {
                v: m for v, m in candidates.items() if v not in unusable and _filed_under(arm, v, m)
            }
            path = lineage.sync_path(held, latest, newest_keyframe, available)
            if path is None:
                await abort(
                    context,
                    grpc.StatusCode.DATA_LOSS,
                    f"no intact path from {arm} v{held} to v{latest} (newest keyframe {newest_keyframe}, "
                    f"unusable {sorted(unusable)}); waiting for the next keyframe",
                )
            for version in path:
                manifest = available[version]
                verified = await self._verified_version(manifest)
                if verified is None:
                    unusable.add(version)
                    break
                to_send = verified.frames
                if (
                    resume is not None
                    and resume.version == version
                    and resume.blob_checksum == manifest.blob_checksum
                    and 0 < resume.offset < len(verified.blob)
                ):
                    to_send = frames(manifest, verified.blob, self._chunk_bytes, resume.offset)
                    self.resumed += 1
                resume = None
                for frame in to_send:
                    yield frame
                held = version

    async def _verified_version(self, manifest: weights_pb2.Manifest) -> VerifiedVersion | None:
        verified = self._verified.get(manifest)
        if verified is not None:
            return verified
        # Every stream of an arm wants the new version at once: one read and one hash serve them all.
        key = (manifest.arm, manifest.version, manifest.blob_checksum)
        loading = self._loading.get(key)
        if loading is None:
            loading = asyncio.create_task(self._load_version(manifest))
            self._loading[key] = loading
            loading.add_done_callback(lambda _: self._loading.pop(key, None))
            loading.add_done_callback(retrieve_exception)
        return await asyncio.shield(loading)

    async def _load_version(self, manifest: weights_pb2.Manifest) -> VerifiedVersion | None:
        blob = await self._source.blob(manifest)
        if blob is None:
            log.error(
                "blob of %s v%d is missing: %s", manifest.arm, manifest.version, manifest.blob_uri
            )
            return None
        if (
            len(blob) != manifest.blob_size
            or await asyncio.to_thread(xxh3_hex, blob) != manifest.blob_checksum
        ):
            log.error(
                "blob of %s v%d is corrupt (checksum mismatch): %s",
                manifest.arm,
                manifest.version,
                manifest.blob_uri,
            )
            return None
        verified = VerifiedVersion(blob, frames(manifest, blob, self._chunk_bytes))
        self._verified.put(manifest, verified)
        return verified

    @staticmethod
    async def _authorize(context, bearers: tuple[bytes, ...], doing: str) -> None:
        supplied = dict(context.invocation_metadata()).get("authorization", "").encode()
        # compare_digest against every token, so the time taken does not say which one nearly matched.
        matches = [hmac.compare_digest(supplied, bearer) for bearer in bearers]
        if not any(matches):
            await abort(
                context,
                grpc.StatusCode.UNAUTHENTICATED,
                f"{doing} needs metadata 'authorization: Bearer <token>' with a valid token",
            )


def _filed_under(arm: str, version: int, manifest: weights_pb2.Manifest) -> bool:
    """Whether the manifest is the version its registry key names. weight_sync files each
    manifest under its own arm and version; one found elsewhere was written by someone
    else, and streamed it would tell the subscriber it now holds some other version, so
    the stream would send it again and again."""
    if manifest.arm == arm and manifest.version == version:
        return True
    log.error(
        "the manifest filed as %s v%d is %s v%d: not streamed (the registry was written "
        "by something other than weight_sync)",
        arm,
        version,
        manifest.arm,
        manifest.version,
    )
    return False


async def valid_arm(arm: str, context) -> str:
    try:
        return check_arm(arm)
    except ValueError as exc:
        await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))


def observe_fanout(prefix: str, service: Broadcaster) -> None:
    """A broadcaster's (server's or relay's) fan-out as OpenTelemetry (and so Prometheus) metrics."""
    meter = metrics.get_meter(prefix)
    otel.observe(
        meter,
        f"{prefix}.subscribers",
        "gauge",
        lambda: [(service.subscribers, {})],
        unit="{subscriber}",
        description="Open Subscribe streams",
    )
    otel.observe(
        meter,
        f"{prefix}.sent",
        "counter",
        lambda: [(service.bytes_sent, {})],
        unit="By",
        description="Weight bytes streamed to subscribers",
    )
