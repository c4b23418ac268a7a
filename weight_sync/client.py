"""Clients of weight_sync (synchronous gRPC): the trainer's Publisher and the
inference worker's Subscriber. Both encode and decode locally with codec.py; the
server never looks inside a blob.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator, Mapping

import grpc
import torch

from rtrl.v1 import weights_pb2, weights_pb2_grpc
from weight_sync import codec, lineage
from weight_sync.checksum import xxh3_hex

log = logging.getLogger("weight_sync.client")

# gRPC's own reconnect backoff starts at 1 s and grows to 120 s; a worker should
# find a restarted server within a couple of seconds.
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
# Worth subscribing again after: the server went away, or cannot build a path yet
# (DATA_LOSS until the next keyframe repairs a corrupt chain). Anything else is a bug or misconfiguration.
_RESUBSCRIBE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


class Publisher:
    """Publishes successive weights of one arm; used by the trainer (one per arm).

    Keeps a copy of the last weights it published, so each version after the first
    is a delta against it, except every keyframe_every-th version, which is full.
    """

    def __init__(self, addr: str, token: str, arm: str, keyframe_every: int = 20, *, chunk_bytes: int = 1 << 20, timeout_s: float = 60.0) -> None:
        if keyframe_every < 1 or chunk_bytes < 1:
            raise ValueError(f"keyframe_every ({keyframe_every}) and chunk_bytes ({chunk_bytes}) must be positive")
        self.arm = arm
        self.keyframe_every = keyframe_every
        self._chunk_bytes = chunk_bytes
        self._timeout_s = timeout_s
        self._metadata = (("authorization", f"Bearer {token}"),)
        self._channel = grpc.insecure_channel(addr, options=CHANNEL_OPTIONS)
        self._stub = weights_pb2_grpc.WeightSyncStub(self._channel)
        self._parent: dict[str, torch.Tensor] | None = None
        self._parent_version = -1

    def latest(self) -> int:
        request = weights_pb2.LatestRequest(arm=self.arm)
        return self._stub.Latest(request, timeout=self._timeout_s, wait_for_ready=True).version

    def publish(
        self,
        weights: Mapping[str, torch.Tensor],
        *,
        trained_through_event_ts_ms: int = 0,
        rollouts_trained: int = 0,
        train_step: int = 0,
    ) -> int:
        """Publish the weights as the arm's next version and return that version.

        If another publisher got there first (FAILED_PRECONDITION), publishes once
        more as a keyframe on top of the server's latest version.
        """
        snapshot = {name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in weights.items()}
        stats = dict(trained_through_event_ts_ms=trained_through_event_ts_ms, rollouts_trained=rollouts_trained, train_step=train_step)
        if self._parent is None:
            self._parent_version = self.latest()
        keyframe = self._parent is None or lineage.keyframe_due(self._parent_version + 1, self.keyframe_every)
        try:
            version = self._send(snapshot, self._parent_version, keyframe, stats)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            log.warning("publish of %s refused (%s); resending as a keyframe", self.arm, exc.details())
            version = self._send(snapshot, self.latest(), True, stats)
        self._parent, self._parent_version = snapshot, version
        return version

    def close(self) -> None:
        self._channel.close()

    def _send(self, weights: dict[str, torch.Tensor], parent_version: int, keyframe: bool, stats: dict[str, int]) -> int:
        encoded = codec.encode(None if keyframe else self._parent, weights)
        manifest = encoded.manifest(arm=self.arm, parent_version=parent_version, keyframe=keyframe, **stats)
        blob = encoded.blob
        response = self._stub.Publish(
            _publish_chunks(manifest, blob, self._chunk_bytes),
            metadata=self._metadata,
            timeout=self._timeout_s,
            wait_for_ready=True,
        )
        return response.version


def _publish_chunks(manifest: weights_pb2.Manifest, blob: bytes, chunk_bytes: int) -> Iterator[weights_pb2.PublishChunk]:
    for offset in range(0, max(len(blob), 1), chunk_bytes):
        chunk = weights_pb2.PublishChunk(data=blob[offset : offset + chunk_bytes])
        if offset == 0:
            chunk.manifest.CopyFrom(manifest)
        yield chunk


def _assembled(chunks: Iterable[weights_pb2.WeightChunk]) -> Iterator[tuple[weights_pb2.Manifest, bytes]]:
    """Whole versions (manifest, blob) out of a Subscribe stream."""
    manifest: weights_pb2.Manifest | None = None
    parts: list[bytes] = []
    size = 0
    for chunk in chunks:
        if chunk.HasField("manifest"):
            if manifest is not None:
                raise codec.DecodeError(f"version {chunk.version} started before version {manifest.version} ended")
            manifest, parts, size = chunk.manifest, [], 0
        if manifest is None or chunk.version != manifest.version or chunk.offset != size:
            raise codec.DecodeError(f"torn stream at version {chunk.version}, offset {chunk.offset}")
        parts.append(chunk.data)
        size += len(chunk.data)
        if chunk.last:
            yield manifest, b"".join(parts)
            manifest = None


class Subscriber:
    """Follows one arm's versions; run by an inference worker in a thread.

    ``follow`` yields (manifest, weights) for every version newer than any it yielded
    before, each fully decoded and checksum-verified; it never yields a corrupt or
    half-received version. The yielded tensors are the subscriber's own copy of the
    weights it will apply the next delta to: read them, do not modify them in place.
    """

    def __init__(self, addr: str, arm: str, worker_id: str, *, min_backoff_s: float = 0.1, max_backoff_s: float = 2.0) -> None:
        self.arm = arm
        self.worker_id = worker_id
        self._min_backoff_s = min_backoff_s
        self._max_backoff_s = max_backoff_s
        self._channel = grpc.insecure_channel(addr, options=CHANNEL_OPTIONS)
        self._stub = weights_pb2_grpc.WeightSyncStub(self._channel)
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._call = None
        # Times the stream was opened again (connection lost or a version discarded),
        # and versions that failed verification and were thrown away.
        self.resubscribes = 0
        self.discarded = 0

    def follow(
        self, have_version: int = -1, weights: dict[str, torch.Tensor] | None = None
    ) -> Iterator[tuple[weights_pb2.Manifest, dict[str, torch.Tensor]]]:
        """Yield each new version of the arm until stop().

        With the weights of have_version, the stream starts with the deltas after it.
        With have_version alone, it starts from a keyframe but still yields only
        versions newer than have_version.
        """
        if weights is not None and have_version < 0:
            raise ValueError("weights were given without the version they are")
        held_version, held = (have_version, weights) if weights is not None else (-1, None)
        yielded = have_version
        backoff_s = self._min_backoff_s
        while not self._stopped.is_set():
            request = weights_pb2.SubscribeRequest(arm=self.arm, have_version=held_version, worker_id=self.worker_id, follow=True)
            call = self._stub.Subscribe(request, wait_for_ready=True)
            with self._lock:
                self._call = call
            if self._stopped.is_set():
                call.cancel()
            try:
                for manifest, blob in _assembled(call):
                    if not manifest.keyframe and manifest.parent_version != held_version:
                        raise codec.ParentMismatch(f"{self.arm} v{manifest.version} is a delta on v{manifest.parent_version}, we hold v{held_version}")
                    held = codec.decode(blob, manifest, held)
                    held_version = manifest.version
                    backoff_s = self._min_backoff_s
                    if held_version > yielded:
                        yielded = held_version
                        yield manifest, held
            except codec.DecodeError as exc:
                # Our copy may be what is wrong, so start over from a keyframe.
                log.error("%s: discarding a version of %s: %s; re-subscribing from a keyframe", self.worker_id, self.arm, exc)
                self.discarded += 1
                held_version, held = -1, None
            except grpc.RpcError as exc:
                if self._stopped.is_set():
                    return
                if exc.code() not in _RESUBSCRIBE:
                    raise
                log.warning("%s: stream of %s ended (%s: %s); re-subscribing from v%d", self.worker_id, self.arm, exc.code().name, exc.details(), held_version)
            finally:
                call.cancel()
            self.resubscribes += 1
            self._stopped.wait(backoff_s)
            backoff_s = min(backoff_s * 2, self._max_backoff_s)

    def stop(self) -> None:
        """End follow() (from any thread)."""
        self._stopped.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()

    def close(self) -> None:
        self.stop()
        self._channel.close()
