"""Clients of weight_sync (synchronous gRPC): the trainer's Publisher and the
inference worker's Subscriber. Both encode and decode locally with codec.py; the
server never looks inside a blob.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import grpc
import torch
from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from rtrl import otel, tls
from rtrl.v1 import weights_pb2, weights_pb2_grpc
from rtrl.weight_sync import codec, lineage
from rtrl.weight_sync.provenance import ManifestSigner, ManifestVerifier
from rtrl.weight_sync.refusals import FORGED, ROLLED_BACK, UNDECODABLE, Refusals
from rtrl.weight_sync.refusals import RefusalBackoff as RefusalBackoff  # for workers' followers
from rtrl.weight_sync.stream import CHANNEL_OPTIONS, VersionStream, bearer

log = logging.getLogger("rtrl.weight_sync.client")
_tracer = trace.get_tracer("rtrl.weight_sync")


class Publisher:
    """Publishes successive weights of one arm; used by the trainer (one per arm).

    Keeps a copy of the last weights it published, so each version after the first
    is a delta against it, except every keyframe_every-th version, which is full.
    Every manifest is signed with ``signing_key`` (provenance.py): workers apply only
    versions that verify.
    """

    def __init__(
        self,
        addr: str,
        token: str,
        arm: str,
        keyframe_every: int = 20,
        *,
        signing_key: str,
        chunk_bytes: int = 1 << 20,
        timeout_s: float = 60.0,
        tls_ca_file: Path | None = None,
    ) -> None:
        if keyframe_every < 1 or chunk_bytes < 1:
            raise ValueError(
                f"keyframe_every ({keyframe_every}) and chunk_bytes ({chunk_bytes}) must be positive"
            )
        self._signer = ManifestSigner(signing_key)
        self.arm = arm
        self.keyframe_every = keyframe_every
        self._chunk_bytes = chunk_bytes
        self._timeout_s = timeout_s
        self._metadata = bearer(token)
        self._channel = _sync_channel(addr, tls_ca_file)
        self._stub = weights_pb2_grpc.WeightSyncStub(self._channel)
        self._parent: dict[str, torch.Tensor] | None = None
        self._parent_version = -1
        # Wall-clock time (time.time()) the last Publish call started, after encoding:
        # where the version leaves the trainer, for latency measurements.
        self.last_upload_started_s = 0.0
        self._buffers = codec.EncodeBuffers()

    def latest(self) -> int:
        request = weights_pb2.LatestRequest(arm=self.arm)
        return self._stub.Latest(
            request, metadata=self._metadata, timeout=self._timeout_s, wait_for_ready=True
        ).version

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
        snapshot = {
            name: tensor.detach().to("cpu", copy=True).contiguous()
            for name, tensor in weights.items()
        }
        stats = {
            "trained_through_event_ts_ms": trained_through_event_ts_ms,
            "rollouts_trained": rollouts_trained,
            "train_step": train_step,
        }
        if self._parent is None:
            self._parent_version = self.latest()
        keyframe = self._parent is None or lineage.keyframe_due(
            self._parent_version + 1, self.keyframe_every
        )
        try:
            version = self._send(snapshot, self._parent_version, keyframe, stats)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            log.warning(
                "publish of %s refused (%s); resending as a keyframe", self.arm, exc.details()
            )
            version = self._send(snapshot, self.latest(), True, stats)
        self._parent, self._parent_version = snapshot, version
        return version

    def close(self) -> None:
        self._channel.close()

    def _send(
        self,
        weights: dict[str, torch.Tensor],
        parent_version: int,
        keyframe: bool,
        stats: dict[str, int],
    ) -> int:
        encoded = codec.encode(None if keyframe else self._parent, weights, self._buffers)
        manifest = encoded.manifest(
            arm=self.arm, parent_version=parent_version, keyframe=keyframe, **stats
        )
        self._signer.sign(manifest)
        blob = encoded.blob
        attributes: dict[str, AttributeValue] = {
            "rpc.system": "grpc",
            "rpc.method": "rtrl.v1.WeightSync/Publish",
            "rtrl.arm": self.arm,
            "rtrl.weights.keyframe": keyframe,
            "rtrl.weights.bytes": len(blob),
        }
        with _tracer.start_as_current_span(
            "weights publish", kind=trace.SpanKind.CLIENT, attributes=attributes
        ) as span:
            manifest.traceparent = otel.traceparent_of(span)
            self.last_upload_started_s = time.time()
            response = self._stub.Publish(
                _publish_chunks(manifest, blob, self._chunk_bytes),
                metadata=self._metadata,
                timeout=self._timeout_s,
                wait_for_ready=True,
            )
            span.set_attribute("rtrl.policy.version", response.version)
        return response.version


def _publish_chunks(
    manifest: weights_pb2.Manifest, blob: bytes, chunk_bytes: int
) -> Iterator[weights_pb2.PublishChunk]:
    for offset in range(0, max(len(blob), 1), chunk_bytes):
        chunk = weights_pb2.PublishChunk(data=blob[offset : offset + chunk_bytes])
        if offset == 0:
            chunk.manifest.CopyFrom(manifest)
        yield chunk


def _sync_channel(addr: str, tls_ca_file: Path | None) -> grpc.Channel:
    credentials = tls.client_credentials(tls_ca_file)
    return (
        grpc.secure_channel(addr, credentials, options=CHANNEL_OPTIONS)
        if credentials
        else grpc.insecure_channel(addr, options=CHANNEL_OPTIONS)
    )


def latest_version(
    addr: str, token: str, arm: str, timeout_s: float = 10.0, tls_ca_file: Path | None = None
) -> int:
    """The arm's newest committed version (-1: none), with a subscriber's token."""
    with _sync_channel(addr, tls_ca_file) as channel:
        stub = weights_pb2_grpc.WeightSyncStub(channel)
        request = weights_pb2.LatestRequest(arm=arm)
        return stub.Latest(
            request, metadata=bearer(token), timeout=timeout_s, wait_for_ready=True
        ).version


class Subscriber:
    """Follows one arm's versions; run by an inference worker in a thread.

    ``follow`` yields (manifest, weights) for every version newer than any it yielded
    before, each fully decoded and checksum-verified; it never yields a corrupt or
    half-received version, nor one whose manifest does not verify against
    ``public_keys`` (the trainer's: provenance.py), nor one trained to an earlier step than
    one it took before (a rollback: an old version the trainer did sign, replayed as a new
    one by whoever can write the registry; the signed train_step only ever grows within a
    run). The yielded tensors are the subscriber's own copy of the weights it will apply
    the next delta to: read them, do not modify them in place.

    A refused version is refused once (``refusals``, refusals.py): logged and counted the
    first time, skipped while the subscription stays open, so it is not fetched again
    however long the registry points at it; the subscriber keeps what it holds and takes
    the next valid version as it comes. A worker's follower passes the same ``refusals``
    to each subscriber it starts, so what one refused the next does not count again.
    """

    def __init__(
        self,
        addr: str,
        arm: str,
        worker_id: str,
        *,
        token: str,
        public_keys: Sequence[str],
        min_backoff_s: float = 0.1,
        max_backoff_s: float = 2.0,
        tls_ca_file: Path | None = None,
        newest_step: int = -1,
        refusals: Refusals | None = None,
    ) -> None:
        self._verifier = ManifestVerifier(public_keys)
        self.refusals = refusals if refusals is not None else Refusals()
        self.newest_step = newest_step
        """The highest train_step of a version taken (a worker's earlier subscriber's, too)."""
        self.arm = arm
        self.worker_id = worker_id
        self.stream = VersionStream(
            addr,
            arm,
            worker_id,
            token,
            min_backoff_s=min_backoff_s,
            max_backoff_s=max_backoff_s,
            tls_ca_file=tls_ca_file,
        )

    @property
    def forged(self) -> int:
        """Versions refused because their manifest is not the trainer's for this arm."""
        return self.refusals.counts[FORGED]

    @property
    def rolled_back(self) -> int:
        """Versions refused because they were trained to an earlier step than one taken."""
        return self.refusals.counts[ROLLED_BACK]

    @property
    def undecodable(self) -> int:
        """Versions refused because they cannot be decoded (refusals.UNDECODABLE)."""
        return self.refusals.counts[UNDECODABLE]

    @property
    def resubscribes(self) -> int:
        """Times the stream was opened again (connection lost or a version discarded)."""
        return self.stream.resubscribes

    @property
    def discarded(self) -> int:
        """Versions that failed verification and were thrown away."""
        return self.stream.discarded

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
        for manifest, blob in self.stream.follow(held_version):
            if self._refused(manifest, yielded) or self._builds_on_refused(manifest, held_version):
                self.stream.skip(manifest.version)
                continue
            decoded = self._decode(manifest, blob, held_version, held)
            if decoded is None:
                if self.refusals.failed_to_decode(manifest):
                    self.stream.reject(self.refusals.pause_s())
                    held_version, held = -1, None
                else:
                    self._log_refused(manifest, "it failed to decode again, from a keyframe")
                    self.stream.skip(manifest.version)
                continue
            held_version, held = manifest.version, decoded
            self.newest_step = max(self.newest_step, manifest.train_step)
            self.refusals.taken()
            self.stream.accept(held_version)
            if held_version > yielded:
                yielded = held_version
                yield manifest, held

    def _refused(self, manifest: weights_pb2.Manifest, yielded: int) -> bool:
        """Whether the version is not the trainer's for this arm, or would roll back what
        was yielded, or was refused before. A version is logged and counted the first time
        only. Versions up to ``yielded`` are never yielded again: on a fresh start from a
        keyframe they are the chain to the next version, older by nature."""
        if self.refusals.known(manifest):
            return True
        problem = self._verifier.problem(manifest)
        if problem is not None:
            problem = f"its manifest does not verify ({problem})"
        elif manifest.arm != self.arm:
            problem = f"its manifest is the trainer's for arm {manifest.arm!r}"
        if problem is not None:
            # Not the trainer's version of this arm: nothing of it is decoded.
            self.refusals.refuse(manifest, FORGED)
            self._log_refused(manifest, problem)
            return True
        if manifest.version > yielded and manifest.train_step < self.newest_step:
            self.refusals.refuse(manifest, ROLLED_BACK)
            self._log_refused(
                manifest,
                f"trained to step {manifest.train_step}, before step {self.newest_step} of a "
                "version already taken (an old version replayed: a rollback; a new run's "
                "versions need the worker restarted)",
            )
            return True
        return False

    def _builds_on_refused(self, manifest: weights_pb2.Manifest, held_version: int) -> bool:
        """Whether the version is a delta on the version the stream skipped last: it can
        never be decoded here, and starting over would only fetch the refused one again."""
        skipped = self.stream.held
        if manifest.keyframe or skipped == held_version or manifest.parent_version != skipped:
            return False
        self.refusals.refuse(manifest, UNDECODABLE)
        self._log_refused(manifest, f"it is a delta on v{skipped}, which was refused")
        return True

    def _log_refused(self, manifest: weights_pb2.Manifest, why: str) -> None:
        log.error(
            "%s: refusing %s v%d: %s; keeping what it holds, and skipping this version "
            "until a newer one comes",
            self.worker_id,
            self.arm,
            manifest.version,
            why,
        )

    def _decode(
        self,
        manifest: weights_pb2.Manifest,
        blob: bytes,
        held_version: int,
        held: dict[str, torch.Tensor] | None,
    ) -> dict[str, torch.Tensor] | None:
        """The version's weights, decoded onto ``held`` (the weights of ``held_version``);
        None, logged, when it does not decode or is a delta on another version."""
        try:
            if not manifest.keyframe and manifest.parent_version != held_version:
                raise codec.ParentMismatch(
                    f"{self.arm} v{manifest.version} is a delta on v{manifest.parent_version}, "
                    f"we hold v{held_version}"
                )
            return codec.decode(blob, manifest, held)
        except codec.DecodeError as exc:
            # Our copy may be what is wrong, so the caller starts over from a keyframe (once).
            log.error(
                "%s: discarding %s v%d: %s",
                self.worker_id,
                self.arm,
                manifest.version,
                exc,
            )
            return None

    def stop(self) -> None:
        """End follow() (from any thread)."""
        self.stream.stop()

    def close(self) -> None:
        self.stream.close()
