"""Following one arm's versions as verified blobs, across dropped connections.

VersionStream is the byte-level half of a subscriber, shared by the inference
worker's Subscriber (which decodes each blob into weights) and by relays (which
only pass blobs on). It never imports torch.

A version arrives as WeightChunks; the first carries the manifest. When the stream
breaks inside a version, the next Subscribe names the version, the offset reached
and the blob checksum, and the server continues from there: what arrived is never
sent again. A version is yielded only whole and only when its bytes hash to the
manifest's blob checksum.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from rtrl import tls
from rtrl.v1 import weights_pb2, weights_pb2_grpc
from rtrl.weight_sync.checksum import xxh3_hex

log = logging.getLogger("rtrl.weight_sync.stream")

# gRPC's own reconnect backoff starts at 1 s and grows to 120 s; a worker should
# find a restarted server within a couple of seconds.
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", 16 << 20),
    ("grpc.http2.lookahead_bytes", 16 << 20),
]
# While a rejected stream pauses before starting over, the arm's latest is asked this
# often: a new version ends the pause (refusals.py).
LATEST_RECHECK_S = 1.0
# Worth subscribing again after: the server went away, or cannot build a path yet
# (DATA_LOSS until the next keyframe repairs a corrupt chain). Anything else is a bug or misconfiguration.
RESUBSCRIBE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)


def open_channel(
    addr: str, credentials: grpc.ChannelCredentials | None, options
) -> grpc.aio.Channel:
    """A channel to weight_sync (or a relay): TLS when the caller trusts a CA for it."""
    options = list(options)
    return (
        grpc.aio.secure_channel(addr, credentials, options=options)
        if credentials
        else grpc.aio.insecure_channel(addr, options=options)
    )


class TornStream(Exception):
    """Chunks that do not continue the version being received, or a blob that does not
    match its manifest: the partial version is dropped, never yielded."""


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@dataclass
class Partial:
    """The version being received: its manifest and the bytes so far."""

    manifest: weights_pb2.Manifest
    parts: list[bytes] = field(default_factory=list)
    size: int = 0

    def resume(self) -> weights_pb2.Resume:
        return weights_pb2.Resume(
            version=self.manifest.version,
            offset=self.size,
            blob_checksum=self.manifest.blob_checksum,
        )


class Assembler:
    """Whole versions out of WeightChunks, possibly spread over several streams."""

    def __init__(self) -> None:
        self.partial: Partial | None = None

    def add(self, chunk: weights_pb2.WeightChunk) -> tuple[weights_pb2.Manifest, bytes] | None:
        """The (manifest, blob) this chunk completes, else None. Raises TornStream."""
        if chunk.HasField("manifest"):
            if chunk.offset == 0:
                self.partial = Partial(chunk.manifest)
            elif not self._resumes(chunk):
                self.partial = None
                raise TornStream(
                    f"v{chunk.version} resumed at offset {chunk.offset}, which is not where we stopped"
                )
        partial = self.partial
        if (
            partial is None
            or chunk.version != partial.manifest.version
            or chunk.offset != partial.size
        ):
            self.partial = None
            raise TornStream(f"torn stream at v{chunk.version}, offset {chunk.offset}")
        partial.parts.append(chunk.data)
        partial.size += len(chunk.data)
        if partial.size > partial.manifest.blob_size:
            self.partial = None
            raise TornStream(
                f"v{chunk.version} ran past its blob size {partial.manifest.blob_size}"
            )
        if not chunk.last:
            return None
        self.partial = None
        blob = b"".join(partial.parts)
        if (
            len(blob) != partial.manifest.blob_size
            or xxh3_hex(blob) != partial.manifest.blob_checksum
        ):
            raise TornStream(
                f"v{partial.manifest.version}: received {len(blob)} bytes hashing to {xxh3_hex(blob)}, "
                f"manifest says {partial.manifest.blob_size} bytes, {partial.manifest.blob_checksum}"
            )
        return partial.manifest, blob

    def _resumes(self, chunk: weights_pb2.WeightChunk) -> bool:
        partial = self.partial
        return (
            partial is not None
            and partial.manifest.version == chunk.manifest.version
            and partial.manifest.blob_checksum == chunk.manifest.blob_checksum
            and partial.size == chunk.offset
        )


class AsyncVersionStream:
    """Follows one arm on a WeightSync server (or relay) and yields whole, checksummed
    blobs, on grpc.aio: relays and probes run it on their event loop; workers' threads
    use VersionStream, which drives one on a private loop.

    The caller says which version it holds (``follow(have_version)``) and, after each
    yielded version, whether it accepted it (``accept``), refused it (``skip``: the
    stream goes on after it) or could not use it (``reject``: the stream then starts
    over from a keyframe).
    """

    def __init__(
        self,
        addr: str,
        arm: str,
        worker_id: str,
        token: str,
        *,
        min_backoff_s: float = 0.1,
        max_backoff_s: float = 2.0,
        channel_options: tuple[tuple[str, object], ...] = (),
        tls_ca_file: Path | None = None,
    ) -> None:
        self.addr = addr
        self._credentials = tls.client_credentials(tls_ca_file)
        self._channel_options = [*CHANNEL_OPTIONS, *channel_options]
        self.arm = arm
        self.worker_id = worker_id
        self._metadata = bearer(token)
        self._min_backoff_s = min_backoff_s
        self._max_backoff_s = max_backoff_s
        self._stopped = False
        self._wake: asyncio.Event | None = None
        self._call = None
        self.held = -1
        self._assembler = Assembler()
        self._rejected = False
        self._reject_pause_s: float | None = None
        # Times the stream was opened again, versions thrown away, and bytes received.
        self.resubscribes = 0
        self.discarded = 0
        self.bytes_received = 0

    def accept(self, version: int) -> None:
        self.held = version

    def skip(self, version: int) -> None:
        """The caller refused ``version`` and keeps what it holds. The stream stays open
        and goes on after it, and a later Subscribe starts after it too: weight_sync,
        which sent it, does not send it again (refusals.py)."""
        self.held = version

    def reject(self, pause_s: float | None = None) -> None:
        """The caller could not use the version: start over from a keyframe, after
        ``pause_s`` (cut short when the arm's latest changes), or after the reconnect
        backoff if None."""
        self.discarded += 1
        self.held = -1
        self._rejected = True
        self._reject_pause_s = pause_s

    def stop(self) -> None:
        """End follow(); call it on the stream's event loop."""
        self._stopped = True
        if self._call is not None:
            self._call.cancel()
        if self._wake is not None:
            self._wake.set()

    async def follow(
        self, have_version: int = -1
    ) -> AsyncGenerator[tuple[weights_pb2.Manifest, bytes], None]:
        """Yield (manifest, blob) for each version on the path from have_version, then
        each new one, until stop(). The caller must accept() or reject() each."""
        self.held = have_version
        self._wake = asyncio.Event()
        backoff_s = self._min_backoff_s
        async with open_channel(self.addr, self._credentials, self._channel_options) as channel:
            stub = weights_pb2_grpc.WeightSyncStub(channel)
            while not self._stopped:
                self._call = call = stub.Subscribe(
                    self._request(), metadata=self._metadata, wait_for_ready=True
                )
                try:
                    async for chunk in call:
                        self.bytes_received += len(chunk.data)
                        version = self._assembler.add(chunk)
                        if version is not None:
                            backoff_s = self._min_backoff_s
                            yield version
                            if self._rejected:
                                # The rest of this stream builds on what was rejected: start over from a keyframe.
                                break
                except TornStream as exc:
                    log.error("%s: dropping a version of %s: %s", self.worker_id, self.arm, exc)
                    self.discarded += 1
                except asyncio.CancelledError:
                    # What grpc.aio raises for a call that stop() cancelled, instead of an RpcError.
                    if self._stopped:
                        return
                    raise
                except grpc.RpcError as exc:
                    if self._stopped:
                        return
                    if exc.code() not in RESUBSCRIBE:
                        raise
                    self._log_ended(exc)
                finally:
                    call.cancel()
                    self._call = None
                if self._stopped:
                    return
                self.resubscribes += 1
                await self._wait_to_resubscribe(stub, backoff_s)
                backoff_s = min(backoff_s * 2, self._max_backoff_s)

    async def _wait_to_resubscribe(
        self, stub: weights_pb2_grpc.WeightSyncStub, backoff_s: float
    ) -> None:
        """The reconnect backoff; after a reject with a pause, that pause instead."""
        pause_s = self._reject_pause_s if self._rejected else None
        self._rejected, self._reject_pause_s = False, None
        if pause_s is None:
            await self._sleep(backoff_s)
        else:
            await self._pause(stub, pause_s)

    async def _pause(self, stub: weights_pb2_grpc.WeightSyncStub, pause_s: float) -> None:
        """Wait ``pause_s``, or until the arm's latest is no longer what it was when the
        pause began: a new version is fetched at once, a refused one only after the pause."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + pause_s
        seen = await self._latest(stub)
        while not self._stopped and (left := deadline - loop.time()) > 0:
            await self._sleep(min(left, LATEST_RECHECK_S))
            if seen is None or loop.time() >= deadline:
                continue  # the latest is unknown: only the pause's end can tell
            latest = await self._latest(stub)
            if latest is not None and latest != seen:
                return

    async def _sleep(self, seconds: float) -> None:
        """Sleep, woken early by stop()."""
        assert self._wake is not None  # set by follow() before any wait
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)

    async def _latest(self, stub: weights_pb2_grpc.WeightSyncStub) -> int | None:
        """The arm's latest version, None if it cannot be read now."""
        request = weights_pb2.LatestRequest(arm=self.arm)
        try:
            response = await stub.Latest(request, metadata=self._metadata, timeout=5.0)
        except grpc.RpcError:
            return None
        return response.version

    def _request(self) -> weights_pb2.SubscribeRequest:
        """Subscribe from the version held, resuming the one being received if any."""
        request = weights_pb2.SubscribeRequest(
            arm=self.arm, have_version=self.held, worker_id=self.worker_id, follow=True
        )
        partial = self._assembler.partial
        if partial is not None:
            request.resume.CopyFrom(partial.resume())
        return request

    def _log_ended(self, exc: grpc.RpcError) -> None:
        partial = self._assembler.partial
        where = f", resuming v{partial.manifest.version} at byte {partial.size}" if partial else ""
        log.warning(
            "%s: stream of %s ended (%s: %s); re-subscribing from v%d%s",
            self.worker_id,
            self.arm,
            exc.code().name,
            exc.details(),
            self.held,
            where,
        )


class VersionStream:
    """AsyncVersionStream for a worker's thread: follow() is a plain iterator that runs
    the stream on a private event loop; stop() may be called from any thread."""

    def __init__(
        self,
        addr: str,
        arm: str,
        worker_id: str,
        token: str,
        *,
        min_backoff_s: float = 0.1,
        max_backoff_s: float = 2.0,
        tls_ca_file: Path | None = None,
    ) -> None:
        self._stream = AsyncVersionStream(
            addr,
            arm,
            worker_id,
            token,
            min_backoff_s=min_backoff_s,
            max_backoff_s=max_backoff_s,
            tls_ca_file=tls_ca_file,
        )
        self._loop = asyncio.new_event_loop()
        self._lock = threading.Lock()
        self._stopped = False
        self._following = False
        self._close_requested = False

    def __getattr__(self, name: str):
        # held, resubscribes, discarded, bytes_received, arm, worker_id: the async stream's.
        return getattr(self._stream, name)

    def accept(self, version: int) -> None:
        self._stream.accept(version)

    def skip(self, version: int) -> None:
        self._stream.skip(version)

    def reject(self, pause_s: float | None = None) -> None:
        self._stream.reject(pause_s)

    def follow(self, have_version: int = -1) -> Iterator[tuple[weights_pb2.Manifest, bytes]]:
        with self._lock:
            if self._loop.is_closed():
                return
            self._following = True
        versions = self._stream.follow(have_version)
        try:
            while not self._stopped:
                try:
                    yield self._loop.run_until_complete(anext(versions))
                except StopAsyncIteration:
                    return
        finally:
            self._loop.run_until_complete(versions.aclose())
            with self._lock:
                self._following = False
                if self._close_requested:
                    self._loop.close()

    def stop(self) -> None:
        """End follow() (from any thread)."""
        with self._lock:
            self._stopped = True
            if not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._stream.stop)

    def close(self) -> None:
        """Stop, and release the loop once follow() has let go of it."""
        self.stop()
        with self._lock:
            self._close_requested = True
            if not self._following and not self._loop.is_closed():
                self._loop.close()
