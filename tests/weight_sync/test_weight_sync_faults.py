"""Breaking weight_sync on purpose (docs/architecture.md, guarantee 4).

Connections cut in the middle of a version, streams that end early or skip a chunk,
a delta whose blob is lost, a subscriber process killed mid-version, a blob that rots
after the server verified it. Each test proves the fault is noticed, repaired (by
resuming where the stream stopped, or from the newest keyframe), and that no
subscriber ever yields a partial version or a delta applied to the wrong parent.

Subscribers reach the real in-process server through netfault.FaultProxy, which cuts,
holds and slows their connections; Redis and the blob store are the real ones too.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import threading
import time
from concurrent import futures

import grpc
import pytest
import redis

from rtrl import procs
from rtrl.config import StackSettings
from rtrl.v1 import weights_pb2, weights_pb2_grpc
from rtrl.weight_sync import codec, registry
from rtrl.weight_sync.broadcast import version_chunks
from rtrl.weight_sync.checksum import xxh3_hex
from rtrl.weight_sync.client import Publisher, Subscriber
from rtrl.weight_sync.config import WeightSyncSettings
from rtrl.weight_sync.provenance import ManifestSigner
from rtrl.weight_sync.stream import Assembler, TornStream, bearer
from support import subscriber_proc, wait
from support.netfault import FaultProxy
from support.redis_reply import stored
from support.subscriber_proc import weights_checksum
from support.weight_sync import (
    ARM,
    MANIFEST_KEY,
    MANIFEST_PUBLIC_KEYS,
    SUBSCRIBE_TOKEN,
    Following,
    InProcessServer,
    assert_bit_identical,
    publish_versions,
    train_step,
)

pytestmark = pytest.mark.integration
CHUNK_BYTES = 64 * 1024


@pytest.fixture
def server(stack):
    # Small chunks, so the ~2.4 MB keyframe spans ~40 WeightChunks and a cut lands inside one.
    handle = InProcessServer(
        WeightSyncSettings(port=procs.free_port(), chunk_bytes=CHUNK_BYTES, poll_interval_s=0.2),
        stack,
    )
    handle.start()
    yield handle
    handle.close()


@pytest.fixture
def proxy(server):
    with FaultProxy(server.settings.port) as proxy:
        yield proxy


def new_publisher(
    server: InProcessServer, stack: StackSettings, keyframe_every: int = 20
) -> Publisher:
    return Publisher(
        server.addr,
        stack.weight_sync_token.get_secret_value(),
        ARM,
        keyframe_every=keyframe_every,
        signing_key=MANIFEST_KEY,
    )


def stored_manifest(stack: StackSettings, version: int) -> weights_pb2.Manifest:
    client = redis.Redis.from_url(stack.redis_url)
    try:
        return weights_pb2.Manifest.FromString(stored(client, registry.manifest_key(ARM, version)))
    finally:
        client.close()


def blob_path(stack: StackSettings, version: int):
    return stack.state_dir / "blobs" / ARM / f"{version}.blob"


def subscribe_once(addr: str, have_version: int) -> grpc.StatusCode:
    """How a one-shot (non-following) Subscribe from have_version ends."""
    channel = grpc.insecure_channel(addr)
    request = weights_pb2.SubscribeRequest(arm=ARM, have_version=have_version, worker_id="probe")
    try:
        list(
            weights_pb2_grpc.WeightSyncStub(channel).Subscribe(
                request, metadata=bearer(SUBSCRIBE_TOKEN), timeout=10
            )
        )
    except grpc.RpcError as exc:
        return exc.code()
    finally:
        channel.close()
    return grpc.StatusCode.OK


# --- a connection cut inside a version -------------------------------------------------


@pytest.mark.parametrize("cuts", [1, 2])
def test_a_cut_inside_a_version_resumes_where_it_stopped(
    server, stack, proxy, policy_weights, cuts
):
    publisher = new_publisher(server, stack)
    versions = publish_versions(publisher, policy_weights, 1)
    blob_size = stored_manifest(stack, 0).blob_size
    assert blob_size > 10 * CHUNK_BYTES
    # ~2 s for the keyframe, so the test can cut it where it chooses.
    proxy.throttle(blob_size / 2)
    subscriber = Subscriber(
        proxy.addr, ARM, "worker-cut", token=SUBSCRIBE_TOKEN, public_keys=MANIFEST_PUBLIC_KEYS
    )
    following = Following(subscriber)
    try:
        for cut in range(1, cuts + 1):
            # Cut once the subscriber has taken in cut/(cuts + 1) of v0 (bytes in the
            # proxy's or gRPC's buffers do not count), so every reconnect has a resume.
            wait.until(
                lambda: subscriber.stream.bytes_received,
                f"cut point {cut} of v0",
                ready=wait.at_least(cut * blob_size // (cuts + 1)),
                interval_s=0.01,
            )
            proxy.cut_all()
            assert subscriber.stream.bytes_received < blob_size, "the cut came after v0 was whole"
        manifest, weights = following.next()
    finally:
        following.stop()
        publisher.close()
    assert manifest.version == 0
    assert_bit_identical(weights, versions[0])
    assert server.server.service.resumed == cuts
    assert subscriber.resubscribes >= cuts and subscriber.discarded == 0
    # gRPC hands over whole messages only, and each resume starts at the first byte not
    # taken in, so the blob arrived exactly once: only chunks cut in half were sent again
    # (the weaker bound would be fewer than blob_size + cuts * CHUNK_BYTES).
    assert subscriber.stream.bytes_received == blob_size


def _collect_the_version(
    server: InProcessServer, stack: StackSettings, publisher: Publisher, old: dict
) -> tuple[int, dict]:
    """Two newer keyframes, then garbage collection (keep_keyframes=2) deletes v0."""
    newer = [train_step(old, 1), train_step(old, 2)]
    assert [publisher.publish(w, train_step=step) for step, w in enumerate(newer, 1)] == [1, 2]
    plans = server._run(server.running.collect_garbage())
    assert [plan.versions for plan in plans] == [(0,)] and not blob_path(stack, 0).exists()
    return 2, newer[-1]


def _replace_the_version(
    server: InProcessServer, stack: StackSettings, publisher: Publisher, old: dict
) -> tuple[int, dict]:
    """The registry and the blob store are both lost (so nothing can be rebuilt) and a
    trainer publishes other weights as v0 again: same version, different blob."""
    shutil.rmtree(stack.state_dir / "blobs")
    client = redis.Redis.from_url(stack.redis_url)
    client.flushdb()
    client.close()
    rival = new_publisher(server, stack)
    wait.until(
        rival.latest,
        "the server's Latest to report the emptied registry (-1)",
        ready=lambda latest: latest == -1,
        timeout_s=5,
    )
    replacement = train_step(old, 3)
    assert rival.publish(replacement) == 0
    rival.close()
    return 0, replacement


@pytest.mark.parametrize(
    "change",
    [_collect_the_version, _replace_the_version],
    ids=["the version was garbage-collected", "the version was replaced by another blob"],
)
def test_a_resume_the_server_cannot_honour_starts_over_and_never_mixes_blobs(
    server, stack, proxy, policy_weights, change
):
    publisher = new_publisher(server, stack, keyframe_every=1)
    old = publish_versions(publisher, policy_weights, 1)[0]
    old_checksum, blob_size = (
        stored_manifest(stack, 0).blob_checksum,
        stored_manifest(stack, 0).blob_size,
    )
    proxy.throttle(blob_size / 2)
    subscriber = Subscriber(
        proxy.addr,
        ARM,
        "worker-stale-resume",
        token=SUBSCRIBE_TOKEN,
        public_keys=MANIFEST_PUBLIC_KEYS,
    )
    following = Following(subscriber)
    try:
        wait.until(
            lambda: subscriber.stream.bytes_received,
            "half of v0 to arrive",
            ready=lambda received: received >= blob_size // 2,
            interval_s=0.01,
        )
        # The subscriber's reconnect, with its resume, waits at the proxy while the server's state changes.
        proxy.hold()
        proxy.cut_all()
        assert subscriber.stream.bytes_received < blob_size, "the cut came after v0 was whole"
        wait.until(
            lambda: server.server.service.subscribers,
            "the server to notice the cut",
            ready=lambda subscribers: subscribers == 0,
        )
        expected_version, expected = change(server, stack, publisher, old)
        proxy.throttle(None)
        proxy.release()
        manifest, weights = following.next()
        # Nothing else may follow: a sentinel version published now must be the next one.
        assert publisher.publish(train_step(expected, 9), train_step=9) == expected_version + 1
        assert following.next()[0].version == expected_version + 1
        assert following.nothing_pending()
    finally:
        following.stop()
        publisher.close()
    assert manifest.version == expected_version and manifest.blob_checksum != old_checksum
    assert_bit_identical(weights, expected)
    assert server.server.service.resumed == 0
    # The server began again at offset 0 with the manifest, so the half-received v0
    # was replaced cleanly: nothing torn, nothing discarded, no old bytes in the new blob.
    assert subscriber.discarded == 0


# --- streams that end early or skip bytes ---------------------------------------------

_BLOB = bytes(range(256)) * 40
_MANIFEST = weights_pb2.Manifest(
    arm=ARM, version=7, blob_size=len(_BLOB), blob_checksum=xxh3_hex(_BLOB)
)
_OTHER_BLOB = bytes(reversed(_BLOB))
_OTHER_MANIFEST = weights_pb2.Manifest(
    arm=ARM, version=7, blob_size=len(_OTHER_BLOB), blob_checksum=xxh3_hex(_OTHER_BLOB)
)


def _chunks(
    start: int = 0, chunk_bytes: int = 1024, manifest=_MANIFEST, blob=_BLOB
) -> list[weights_pb2.WeightChunk]:
    return list(version_chunks(manifest, blob, chunk_bytes, start))


def _changed(chunk: weights_pb2.WeightChunk, **fields) -> weights_pb2.WeightChunk:
    changed = weights_pb2.WeightChunk()
    changed.CopyFrom(chunk)
    for name, value in fields.items():
        setattr(changed, name, value)
    return changed


_WHOLE = _chunks()
_STRAY = weights_pb2.WeightChunk(version=8, offset=4096, data=b"x" * 1024)


# What an Assembler is fed (a whole stream, or a broken one and its continuation), and
# whether the version comes out whole or the stream is torn (TornStream, nothing yielded).
@pytest.mark.parametrize(
    "chunks, torn",
    [
        (_WHOLE, False),
        # A resume continues from the first byte not received, at any chunk size (a relay's).
        (_WHOLE[:4] + _chunks(start=4096), False),
        (_WHOLE[:4] + _chunks(start=4096, chunk_bytes=3000), False),
        # The server could not resume and starts the version over.
        (_WHOLE[:4] + _WHOLE, False),
        (_WHOLE[:3] + _WHOLE[4:], True),
        (_WHOLE[:4] + _WHOLE[3:], True),
        (_WHOLE[:3] + [_changed(_WHOLE[3], last=True)], True),
        (
            _WHOLE[:-1]
            + [
                _changed(_WHOLE[-1], last=False),
                weights_pb2.WeightChunk(version=7, offset=len(_BLOB), data=b"x", last=True),
            ],
            True,
        ),
        (_WHOLE[:5] + [_changed(_WHOLE[5], data=bytes(1024))] + _WHOLE[6:], True),
        (_WHOLE[:4] + _chunks(start=5120), True),
        (_WHOLE[:4] + _chunks(start=4096, manifest=_OTHER_MANIFEST, blob=_OTHER_BLOB), True),
        (_WHOLE[1:], True),
        (_WHOLE[:4] + [_STRAY] + _WHOLE[4:], True),
    ],
    ids=[
        "whole, in order",
        "resumed at the next byte",
        "resumed at another chunk size",
        "started over at offset 0",
        "a chunk is missing",
        "a chunk comes twice",
        "the version ends early, marked last",
        "more bytes than the manifest says",
        "bytes changed on the way",
        "resumed past where it stopped",
        "resumed from another blob of the same version",
        "a continuation without the start",
        "another version's chunk in the middle",
    ],
)
def test_assembler_yields_whole_versions_only(chunks, torn):
    assembler = Assembler()
    completed, error = [], None
    for chunk in chunks:
        try:
            whole = assembler.add(chunk)
        except TornStream as exc:
            error = exc
            break
        if whole is not None:
            completed.append(whole[1])
    if torn:
        assert error is not None and completed == [] and assembler.partial is None
    else:
        assert error is None and completed == [_BLOB]
    # Whatever happened, the next whole version comes out.
    assert [assembler.add(chunk) for chunk in _WHOLE][-1] == (_MANIFEST, _BLOB)


class ScriptedWeightSync(weights_pb2_grpc.WeightSyncServicer):
    """A broken server or relay: answers the first Subscribe with `first_stream`, every
    later one correctly (resumes honoured), then stays open as a following stream does."""

    def __init__(self, manifest: weights_pb2.Manifest, blob: bytes, first_stream) -> None:
        self.manifest, self.blob, self.first_stream = manifest, blob, first_stream
        self.requests: list[weights_pb2.SubscribeRequest] = []

    def Subscribe(self, request, context):
        self.requests.append(request)
        if len(self.requests) == 1:
            yield from self.first_stream(
                list(version_chunks(self.manifest, self.blob, CHUNK_BYTES))
            )
            return
        if request.have_version != self.manifest.version:
            resume = request.resume
            start = (
                resume.offset
                if request.HasField("resume")
                and resume.blob_checksum == self.manifest.blob_checksum
                else 0
            )
            yield from version_chunks(self.manifest, self.blob, CHUNK_BYTES, start)
        while context.is_active():
            time.sleep(0.05)


def _skips_a_chunk(chunks):
    return chunks[:3] + chunks[4:]


def _ends_early_marked_last(chunks):
    return chunks[:3] + [_changed(chunks[3], last=True)]


def _ends_early_without_a_word(chunks):
    return chunks[:5]  # and the RPC ends OK, as a relay shutting down would


@pytest.mark.parametrize(
    "first_stream, torn",
    [(_skips_a_chunk, True), (_ends_early_marked_last, True), (_ends_early_without_a_word, False)],
    ids=[
        "a chunk skipped",
        "the version ends early, marked last",
        "the stream ends inside the version",
    ],
)
def test_a_broken_stream_over_grpc_is_dropped_or_resumed_then_repaired(
    policy_weights, first_stream, torn
):
    encoded = codec.encode(None, policy_weights)
    manifest = encoded.manifest(arm=ARM, parent_version=-1, keyframe=True)
    ManifestSigner(MANIFEST_KEY).sign(manifest)
    manifest.version = 0
    servicer = ScriptedWeightSync(manifest, encoded.blob, first_stream)
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    weights_pb2_grpc.add_WeightSyncServicer_to_server(servicer, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    subscriber = Subscriber(
        f"127.0.0.1:{port}",
        ARM,
        "worker-torn",
        token=SUBSCRIBE_TOKEN,
        public_keys=MANIFEST_PUBLIC_KEYS,
    )
    following = Following(subscriber)
    try:
        manifest_got, weights = following.next()
        # The scripted server has only v0, so no sentinel version can follow it: leftovers
        # of the broken stream are given a few tenths of a second to surface.
        time.sleep(0.3)
        assert following.nothing_pending()
    finally:
        following.stop()
        grpc_server.stop(0)
    assert manifest_got.version == 0
    assert_bit_identical(weights, policy_weights)
    second = servicer.requests[1]
    if torn:
        # The partial was dropped: the second request asks for v0 from scratch.
        assert subscriber.discarded == 1 and not second.HasField("resume")
    else:
        # Nothing was wrong with what arrived: the subscriber asks for the rest of it.
        assert subscriber.discarded == 0 and second.resume.offset == 5 * CHUNK_BYTES
        assert subscriber.stream.bytes_received == len(encoded.blob)


# --- a delta whose blob is lost ----------------------------------------------------------


@pytest.mark.guarantee(4)
def test_a_lost_delta_is_never_skipped_and_the_next_keyframe_repairs(
    server, stack, proxy, policy_weights, caplog
):
    publisher = new_publisher(server, stack, keyframe_every=4)
    versions = publish_versions(publisher, policy_weights, 2)
    subscriber = Subscriber(
        proxy.addr,
        ARM,
        "worker-gap",
        token=SUBSCRIBE_TOKEN,
        max_backoff_s=0.3,
        public_keys=MANIFEST_PUBLIC_KEYS,
    )
    following = Following(subscriber)
    try:
        assert [m.version for m, _ in following.until(1)] == [0, 1]
        # The worker drops off holding v1; while it is away v2 and v3 are published and v2's blob is lost.
        proxy.hold()
        proxy.cut_all()
        for seed in (2, 3):
            versions.append(train_step(versions[-1], seed))
            publisher.publish(versions[-1], train_step=len(versions) - 1)
        blob_path(stack, 2).unlink()
        # A server may keep what it verified in memory, and then v2 is not lost to it; a
        # restarted one has only the store (the subscriber's reconnect waits at the proxy).
        server.stop()
        server.start()
        # No path reaches v3 without v2, neither from v1 nor from the keyframe v0.
        assert subscribe_once(server.addr, 1) == grpc.StatusCode.DATA_LOSS
        assert subscribe_once(server.addr, -1) == grpc.StatusCode.DATA_LOSS
        proxy.release()

        def refusals() -> int:
            return sum(
                "DATA_LOSS" in r.getMessage()
                for r in caplog.records
                if r.name == "rtrl.weight_sync.stream"
            )

        wait.until(refusals, "the subscriber to be refused twice", ready=lambda n: n >= 2)
        assert following.nothing_pending(), "something was yielded while no intact path existed"
        versions.append(train_step(versions[-1], 4))
        assert (
            publisher.publish(versions[-1], train_step=len(versions) - 1) == 4
        )  # keyframe_every=4: a keyframe
        manifest, weights = following.next()
        # Nothing else may follow v4: a sentinel v5 published now must be the next version.
        assert publisher.publish(train_step(versions[-1], 5), train_step=len(versions)) == 5
        assert following.next()[0].version == 5
        assert following.nothing_pending()
    finally:
        following.stop()
        publisher.close()
    assert (manifest.version, manifest.keyframe) == (4, True)
    assert_bit_identical(weights, versions[4])
    # v3 never reached the subscriber on top of v1: the server never sent it, so there was nothing to discard.
    assert subscriber.discarded == 0
    assert "blob of treatment v2 is missing" in caplog.text


# --- a subscriber process killed inside a version ---------------------------------------


def test_a_subscriber_killed_mid_version_harms_no_one_and_restarts_clean(
    server, stack, proxy, policy_weights, tmp_path
):
    publisher = new_publisher(server, stack)
    versions = publish_versions(publisher, policy_weights, 3)
    blob_size = stored_manifest(stack, 0).blob_size
    service = server.server.service
    applied = tmp_path / "applied.txt"
    argv, env = subscriber_proc.command(proxy.addr, ARM, "worker-kill9", applied)

    log_path = tmp_path / "subscriber.log"

    def start() -> procs.Proc:
        return procs.spawn("subscriber", argv, log_path, env=env)

    def applied_versions() -> list[int]:
        return (
            [int(line.split()[0]) for line in applied.read_text().splitlines()]
            if applied.exists()
            else []
        )

    bystander = Following(
        Subscriber(
            server.addr, ARM, "bystander", token=SUBSCRIBE_TOKEN, public_keys=MANIFEST_PUBLIC_KEYS
        )
    )
    proc = None
    try:
        assert bystander.until(2)[-1][0].version == 2
        # The keyframe takes ~2 s through the proxy, so the kill lands inside it.
        proxy.throttle(blob_size / 2)
        proc = start()
        wait.until(
            lambda: proxy.bytes_to_client,
            "the subscriber process to be receiving v0",
            ready=lambda sent: sent > blob_size // 5,
            timeout_s=60,
            interval_s=0.01,
            watching=[wait.Watched(proc, log_path)],
        )
        assert service.subscribers == 2
        os.killpg(proc.pid, signal.SIGKILL)
        proc.popen.wait()
        assert applied_versions() == [], "the kill came too late: v0 was already whole"
        wait.until(
            lambda: service.subscribers,
            "the server to drop the killed subscriber's stream",
            ready=lambda subscribers: subscribers == 1,
        )

        versions.append(train_step(versions[-1], 3))
        assert publisher.publish(versions[-1], train_step=len(versions) - 1) == 3
        manifest, weights = bystander.next()
        assert manifest.version == 3
        assert_bit_identical(weights, versions[3])

        proxy.throttle(None)
        proc = start()
        wait.until(
            applied_versions,
            "the restarted subscriber to reach v3",
            ready=lambda applied: applied[-1:] == [3],
            timeout_s=60,
            watching=[wait.Watched(proc, log_path)],
        )
        versions.append(train_step(versions[-1], 4))
        assert publisher.publish(versions[-1], train_step=len(versions) - 1) == 4
        wait.until(
            applied_versions,
            "the restarted subscriber to reach v4",
            ready=lambda applied: applied[-1:] == [4],
            watching=[wait.Watched(proc, log_path)],
        )
    finally:
        if proc is not None:
            proc.stop()
        bystander.stop()
        publisher.close()
    checksums = [weights_checksum(weights) for weights in versions]
    lines = [line.split() for line in applied.read_text().splitlines()]
    assert [(int(version), checksum) for version, checksum in lines] == [
        (v, checksums[v]) for v in range(5)
    ]
    log = (tmp_path / "subscriber.log").read_text()
    assert proc.popen.returncode == 0 and "Traceback" not in log, log[-3000:]


# --- a blob that rots after the server verified it ---------------------------------------


@pytest.mark.guarantee(4)
def test_a_blob_corrupted_after_verification_is_served_from_the_verified_copy(
    server, stack, policy_weights, caplog
):
    publisher = new_publisher(server, stack)
    versions = publish_versions(publisher, policy_weights, 3)
    first = Following(
        Subscriber(
            server.addr,
            ARM,
            "worker-first",
            token=SUBSCRIBE_TOKEN,
            public_keys=MANIFEST_PUBLIC_KEYS,
        )
    )
    try:
        assert first.until(2)[-1][0].version == 2
    finally:
        first.stop()
    blob = bytearray(blob_path(stack, 2).read_bytes())
    blob[len(blob) // 2] ^= 0x01
    blob_path(stack, 2).write_bytes(bytes(blob))
    # Committed blobs are immutable (written aside, fsynced, renamed; never written again),
    # so the bytes the server verified and kept in memory are v2. Serving that copy is as
    # safe as re-reading the disk, and every subscriber checks the checksum again anyway.
    second = Following(
        Subscriber(
            server.addr,
            ARM,
            "worker-second",
            token=SUBSCRIBE_TOKEN,
            public_keys=MANIFEST_PUBLIC_KEYS,
        )
    )
    try:
        received = second.until(2)
    finally:
        second.stop()
    assert_bit_identical(received[-1][1], versions[2])
    # A restarted server has no verified copy: it reads the blob again and the checksum
    # catches the rot, leaving no path to v2 until the next keyframe.
    server.stop()
    server.start()
    assert subscribe_once(server.addr, -1) == grpc.StatusCode.DATA_LOSS
    assert "blob of treatment v2 is corrupt" in caplog.text
    publisher.close()


def test_the_fault_proxy_cuts_after_exactly_n_bytes_and_holds_the_reconnect():
    with (
        socket.create_server(("127.0.0.1", 0)) as target,
        FaultProxy(target.getsockname()[1]) as proxy,
    ):
        cut = proxy.cut_after(50_000, hold=True)
        client = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
        upstream, _ = target.accept()
        upstream.sendall(bytes(100_000))
        received = b""
        with pytest.raises(ConnectionResetError):
            while chunk := client.recv(65536):
                received += chunk
        assert len(received) == 50_000 and cut.is_set()
        # The next connection is held: the client connects, the server never hears of it.
        again = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
        target.settimeout(0.3)
        with pytest.raises(TimeoutError):
            target.accept()
        proxy.release()
        target.settimeout(10)
        upstream_again, _ = target.accept()
        upstream_again.sendall(b"through")
        assert again.recv(16) == b"through"
        for sock in (client, upstream, again, upstream_again):
            sock.close()


def test_the_fault_proxy_closes_live_and_held_connections_when_it_stops():
    def reset_or_closed(sock: socket.socket) -> bool:
        try:
            return sock.recv(1) == b""
        except ConnectionResetError:
            return True

    with socket.create_server(("127.0.0.1", 0)) as target:
        proxy = FaultProxy(target.getsockname()[1])
        live = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
        upstream, _ = target.accept()
        proxy.hold()
        held = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
        wait.until(
            lambda: proxy.connections,
            "the second connection to reach the proxy",
            ready=lambda connections: connections == 2,
        )
        proxy.close()
        assert reset_or_closed(live) and reset_or_closed(held) and reset_or_closed(upstream)
        assert not any(thread.name == "netfault" for thread in threading.enumerate())
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", proxy.port), timeout=1)
        for sock in (live, held, upstream):
            sock.close()
