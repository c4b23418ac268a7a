"""weight_sync end to end: a real gRPC server, a real Redis, blobs on disk.

The server runs in-process on a free port (one test runs `python -m rtrl.weight_sync`
and kills it); Publisher and Subscriber are the clients the trainer and the
inference workers use.
"""

from __future__ import annotations

import os
import signal
import sys

import grpc
import pytest
import redis

from rtrl import procs
from rtrl.config import StackSettings
from rtrl.heartbeat import WeightSyncBeat
from rtrl.v1 import weights_pb2, weights_pb2_grpc
from rtrl.weight_sync import codec, registry
from rtrl.weight_sync.client import Publisher, Subscriber
from rtrl.weight_sync.stream import bearer
from support import wait
from support.beats import beats_of, wait_for_beat
from support.redis_reply import stored
from support.weight_sync import (
    ARM,
    MANIFEST_KEY,
    MANIFEST_PUBLIC_KEYS,
    SUBSCRIBE_TOKEN,
    Following,
    assert_bit_identical,
    publish_versions,
    train_step,
)

pytestmark = pytest.mark.integration


def test_new_subscriber_gets_latest_bit_identical(server, stack, publisher, policy_weights):
    versions = publish_versions(publisher, policy_weights, 5)
    assert publisher.latest() == 4

    client = redis.Redis.from_url(stack.redis_url)
    manifests = [
        weights_pb2.Manifest.FromString(stored(client, registry.manifest_key(ARM, v)))
        for v in range(5)
    ]
    assert [(m.version, m.keyframe, m.parent_version) for m in manifests] == [
        (0, True, -1),
        (1, False, 0),
        (2, False, 1),
        (3, False, 2),
        (4, False, 3),
    ]
    assert manifests[4].trained_through_event_ts_ms == 1004 and manifests[4].train_step == 4
    blob_sizes = [(stack.state_dir / "blobs" / ARM / f"{v}.blob").stat().st_size for v in range(5)]
    assert blob_sizes == [m.blob_size for m in manifests]
    assert max(blob_sizes[1:]) * 100 < blob_sizes[0]  # 15 changed floats vs 0.65 M

    following = Following(
        Subscriber(
            server.addr, ARM, "worker-a", token=SUBSCRIBE_TOKEN, public_keys=MANIFEST_PUBLIC_KEYS
        )
    )
    try:
        received = following.until(4)
    finally:
        following.stop()
    assert [m.version for m, _ in received] == [0, 1, 2, 3, 4]
    assert [m.keyframe for m, _ in received] == [True, False, False, False, False]
    for (_, weights), published in zip(received, versions, strict=True):
        assert_bit_identical(weights, published)

    # Heartbeats come once a second: wait for one written after the subscription. Every
    # test server beats under the same instance name; this one is told by its port.
    def beat() -> WeightSyncBeat | None:
        return next(
            (b for b in beats_of(client, WeightSyncBeat) if b.port == server.running.port), None
        )

    seen = wait.until(
        beat,
        "a beat counting every blob sent",
        ready=lambda seen: seen is not None and seen.bytes_sent >= sum(blob_sizes),
        timeout_s=10,
        interval_s=0.1,
    )
    assert seen is not None
    assert seen.latest == {ARM: 4} and seen.versions_published == 5


def test_subscriber_holding_v1_receives_only_deltas(server, publisher, policy_weights):
    versions = publish_versions(publisher, policy_weights, 5)
    stub = weights_pb2_grpc.WeightSyncStub(grpc.insecure_channel(server.addr))
    chunks = list(
        stub.Subscribe(
            weights_pb2.SubscribeRequest(arm=ARM, have_version=1, worker_id="raw"),
            metadata=bearer(SUBSCRIBE_TOKEN),
            timeout=10,
        )
    )
    assert [c.version for c in chunks if c.last] == [2, 3, 4]
    firsts = [c for c in chunks if c.HasField("manifest")]
    assert [
        (c.manifest.version, c.manifest.keyframe, c.manifest.parent_version) for c in firsts
    ] == [(2, False, 1), (3, False, 2), (4, False, 3)]

    # From scratch, the keyframe arrives in many chunks with contiguous offsets.
    chunks = list(
        stub.Subscribe(
            weights_pb2.SubscribeRequest(arm=ARM, have_version=-1, worker_id="raw"),
            metadata=bearer(SUBSCRIBE_TOKEN),
            timeout=10,
        )
    )
    keyframe_chunks = [c for c in chunks if c.version == 0]
    assert (
        len(keyframe_chunks) > 10
        and keyframe_chunks[0].manifest.keyframe
        and keyframe_chunks[-1].last
    )
    assert [c.offset for c in keyframe_chunks] == [
        64 * 1024 * i for i in range(len(keyframe_chunks))
    ]

    following = Following(
        Subscriber(
            server.addr, ARM, "worker-b", token=SUBSCRIBE_TOKEN, public_keys=MANIFEST_PUBLIC_KEYS
        ),
        have_version=1,
        weights=versions[1],
    )
    try:
        received = following.until(4)
    finally:
        following.stop()
    assert [(m.version, m.keyframe) for m, _ in received] == [(2, False), (3, False), (4, False)]
    assert_bit_identical(received[-1][1], versions[4])

    # Knowing its version but not holding the weights, a worker rebuilds from the keyframe
    # and is handed only what is newer.
    following = Following(
        Subscriber(
            server.addr, ARM, "worker-b2", token=SUBSCRIBE_TOKEN, public_keys=MANIFEST_PUBLIC_KEYS
        ),
        have_version=2,
    )
    try:
        received = following.until(4)
    finally:
        following.stop()
    assert [m.version for m, _ in received] == [3, 4]
    assert_bit_identical(received[-1][1], versions[4])


def test_follow_receives_versions_published_later(server, publisher, policy_weights):
    versions = publish_versions(publisher, policy_weights, 2)
    following = Following(
        Subscriber(
            server.addr, ARM, "worker-c", token=SUBSCRIBE_TOKEN, public_keys=MANIFEST_PUBLIC_KEYS
        )
    )
    try:
        assert following.until(1)[-1][0].version == 1
        assert following.nothing_pending()
        for seed in (10, 11):
            versions.append(train_step(versions[-1], seed))
            version = publisher.publish(versions[-1], train_step=len(versions) - 1)
            manifest, weights = following.next()
            assert manifest.version == version and not manifest.keyframe
            assert_bit_identical(weights, versions[-1])
    finally:
        following.stop()


def test_stale_publisher_resends_a_keyframe(server, stack, publisher, policy_weights):
    versions = publish_versions(publisher, policy_weights, 2)
    rival = Publisher(
        server.addr, stack.weight_sync_token.get_secret_value(), ARM, signing_key=MANIFEST_KEY
    )
    assert (
        rival.publish(train_step(versions[-1], 7), train_step=2) == 2
    )  # a fresh publisher starts with a keyframe
    rival.close()
    # `publisher` still believes v1 is latest: its delta is refused and it resends a keyframe.
    versions.append(train_step(versions[-1], 8))
    assert publisher.publish(versions[-1], train_step=len(versions) - 1) == 3
    following = Following(
        Subscriber(
            server.addr, ARM, "worker-d", token=SUBSCRIBE_TOKEN, public_keys=MANIFEST_PUBLIC_KEYS
        )
    )
    try:
        manifest, weights = following.next()
    finally:
        following.stop()
    assert (manifest.version, manifest.keyframe) == (3, True)
    assert_bit_identical(weights, versions[-1])


def _flip_blob_byte(stack: StackSettings, version: int) -> None:
    path = stack.state_dir / "blobs" / ARM / f"{version}.blob"
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    path.write_bytes(bytes(blob))


def _forge_tensor_checksum(stack: StackSettings, version: int) -> None:
    client = redis.Redis.from_url(stack.redis_url)
    manifest = weights_pb2.Manifest.FromString(stored(client, registry.manifest_key(ARM, version)))
    manifest.tensors[0].checksum = "0" * 32
    client.set(registry.manifest_key(ARM, version), manifest.SerializeToString())


@pytest.mark.guarantee(4)
@pytest.mark.parametrize(
    "corrupt",
    [_flip_blob_byte, _forge_tensor_checksum],
    ids=[
        "blob bytes flipped on disk (server detects)",
        "tensor checksum disagrees (subscriber detects)",
    ],
)
def test_corrupt_version_is_never_yielded_and_the_next_keyframe_repairs(
    server, stack, policy_weights, corrupt, caplog
):
    publisher = Publisher(
        server.addr,
        stack.weight_sync_token.get_secret_value(),
        ARM,
        keyframe_every=4,
        signing_key=MANIFEST_KEY,
    )
    versions = publish_versions(publisher, policy_weights, 3)
    corrupt(stack, 2)
    # The publishing server keeps what it verified in memory; storage goes bad under a
    # server that has to read it back: a restarted one, or another replica.
    server.stop()
    server.start()
    subscriber = Subscriber(
        server.addr,
        ARM,
        "worker-e",
        max_backoff_s=0.5,
        token=SUBSCRIBE_TOKEN,
        public_keys=MANIFEST_PUBLIC_KEYS,
    )
    following = Following(subscriber)
    try:
        assert [m.version for m, _ in following.until(1)] == [0, 1]
        for seed in (3, 4):
            versions.append(train_step(versions[-1], seed))
            publisher.publish(
                versions[-1], train_step=len(versions) - 1
            )  # v3 (delta on the corrupt v2), v4 (keyframe)
        manifest, weights = following.next()
    finally:
        following.stop()
        publisher.close()
    assert (manifest.version, manifest.keyframe) == (4, True)
    assert_bit_identical(weights, versions[4])
    if corrupt is _forge_tensor_checksum:
        # Its manifest no longer verifies: refused once and skipped, v3 (a delta on it) with
        # it, and nothing fetched again (weight_sync/refusals.py).
        assert (subscriber.forged, subscriber.undecodable, subscriber.resubscribes) == (1, 1, 0)
    else:
        assert subscriber.resubscribes >= 1
        assert "blob of treatment v2 is corrupt" in caplog.text


def test_latest_and_bad_arms(server):
    stub = weights_pb2_grpc.WeightSyncStub(grpc.insecure_channel(server.addr))
    metadata = bearer(SUBSCRIBE_TOKEN)
    assert (
        stub.Latest(weights_pb2.LatestRequest(arm="control"), metadata=metadata, timeout=10).version
        == -1
    )
    with pytest.raises(grpc.RpcError) as raised:
        stub.Latest(weights_pb2.LatestRequest(arm="../etc"), metadata=metadata, timeout=10)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# Who may do what: the trainer's token publishes and reads; a worker's token only reads.
@pytest.mark.parametrize(
    "token, may_read, may_publish",
    [
        (None, False, False),
        ("wrong-token", False, False),
        (SUBSCRIBE_TOKEN, True, False),
        (StackSettings().weight_sync_token.get_secret_value(), True, True),
    ],
    ids=["no token", "wrong token", "subscribe token", "publish token"],
)
def test_tokens_scope_publish_and_subscribe(server, policy_weights, token, may_read, may_publish):
    stub = weights_pb2_grpc.WeightSyncStub(grpc.insecure_channel(server.addr))
    metadata = bearer(token) if token else ()

    def outcome(call) -> grpc.StatusCode:
        try:
            call()
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    read = outcome(
        lambda: stub.Latest(weights_pb2.LatestRequest(arm=ARM), metadata=metadata, timeout=10)
    )
    subscribe = outcome(
        lambda: list(
            stub.Subscribe(weights_pb2.SubscribeRequest(arm=ARM), metadata=metadata, timeout=10)
        )
    )
    encoded = codec.encode(None, policy_weights)
    manifest = encoded.manifest(arm=ARM, parent_version=-1, keyframe=True)
    publish = outcome(
        lambda: stub.Publish(
            iter([weights_pb2.PublishChunk(manifest=manifest, data=encoded.blob)]),
            metadata=metadata,
            timeout=30,
        )
    )
    denied = grpc.StatusCode.UNAUTHENTICATED
    assert (read, subscribe) == ((grpc.StatusCode.OK,) * 2 if may_read else (denied,) * 2)
    assert publish == (grpc.StatusCode.OK if may_publish else denied)


def test_a_publish_stream_is_held_to_its_declared_size_as_it_arrives(server, policy_weights):
    """More bytes than the manifest declares are refused on the chunk that overflows, not after
    the whole stream was buffered; a declared size past max_blob_bytes is refused at once."""
    stub = weights_pb2_grpc.WeightSyncStub(grpc.insecure_channel(server.addr))
    metadata = bearer(StackSettings().weight_sync_token.get_secret_value())
    encoded = codec.encode(None, policy_weights)
    manifest = encoded.manifest(arm=ARM, parent_version=-1, keyframe=True)
    sent = []

    def endless():
        yield weights_pb2.PublishChunk(manifest=manifest, data=encoded.blob)
        for _ in range(10_000):  # 10 GB if it were all read
            sent.append(1)
            yield weights_pb2.PublishChunk(data=b"\0" * (1 << 20))

    with pytest.raises(grpc.RpcError) as refused:
        stub.Publish(endless(), metadata=metadata, timeout=60)
    assert (
        refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "more than the" in refused.value.details()
    )
    assert len(sent) < 200, f"{len(sent)} MB were sent before the refusal"

    huge = weights_pb2.Manifest()
    huge.CopyFrom(manifest)
    huge.blob_size = 1 << 40
    with pytest.raises(grpc.RpcError) as refused:
        stub.Publish(
            iter([weights_pb2.PublishChunk(manifest=huge, data=b"")]), metadata=metadata, timeout=30
        )
    assert (
        refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        and "max_blob_bytes" in refused.value.details()
    )
    assert registry_latest(server) == -1, "nothing was published"


def test_weight_sync_will_not_start_without_its_tokens(stack, tmp_path, repo_root):
    """No default token exists: a server given none exits at once and says which are missing."""
    env = {
        "RTRL_REDIS_URL": stack.redis_url,
        "RTRL_STATE_DIR": str(stack.state_dir),
        "RTRL_WEIGHT_SYNC_PORT": str(procs.free_port()),
        "RTRL_WEIGHT_SYNC_TOKEN": "",
        "RTRL_WEIGHT_SYNC_SUBSCRIBE_TOKEN": "",
        "PYTHONPATH": str(repo_root),
    }
    proc = procs.spawn(
        "weight_sync", [sys.executable, "-m", "rtrl.weight_sync"], tmp_path / "ws.log", env=env
    )
    try:
        assert proc.popen.wait(timeout=60) != 0
    finally:
        proc.stop(timeout_s=5)
    log = (tmp_path / "ws.log").read_text()
    assert "RTRL_WEIGHT_SYNC_TOKEN: missing: " in log and "there is no default" in log


def registry_latest(server) -> int:
    stub = weights_pb2_grpc.WeightSyncStub(grpc.insecure_channel(server.addr))
    return stub.Latest(
        weights_pb2.LatestRequest(arm=ARM), metadata=bearer(SUBSCRIBE_TOKEN), timeout=10
    ).version


def test_subscriber_survives_a_killed_server(stack, repo_root, tmp_path, policy_weights):
    port = procs.free_port()
    env = {
        "RTRL_REDIS_URL": stack.redis_url,
        "RTRL_STATE_DIR": str(stack.state_dir),
        "RTRL_WEIGHT_SYNC_PORT": str(port),
        "RTRL_INSTANCE": "killme",
        "PYTHONPATH": str(repo_root),
    }

    def start() -> procs.Proc:
        proc = procs.spawn(
            "weight_sync",
            [sys.executable, "-m", "rtrl.weight_sync"],
            tmp_path / "weight_sync.log",
            env=env,
            port=port,
        )
        procs.wait_for_port(port)
        return proc

    proc = start()
    addr = f"127.0.0.1:{port}"
    publisher = Publisher(
        addr, stack.weight_sync_token.get_secret_value(), ARM, signing_key=MANIFEST_KEY
    )
    subscriber = Subscriber(
        addr, ARM, "worker-f", token=SUBSCRIBE_TOKEN, public_keys=MANIFEST_PUBLIC_KEYS
    )
    following = Following(subscriber)
    try:
        versions = publish_versions(publisher, policy_weights, 2)
        assert following.until(1)[-1][0].version == 1

        resubscribes = subscriber.resubscribes
        os.killpg(proc.pid, signal.SIGKILL)
        proc.popen.wait()
        # The subscriber sees the stream die while nothing listens.
        wait.until(
            lambda: subscriber.resubscribes,
            "the subscriber to see the stream die",
            ready=lambda seen: seen > resubscribes,
        )
        proc = start()
        versions.append(train_step(versions[-1], 5))
        assert publisher.publish(versions[-1], train_step=len(versions) - 1) == 2
        manifest, weights = following.next()
        assert (manifest.version, manifest.keyframe) == (2, False)
        assert_bit_identical(weights, versions[-1])
        assert subscriber.resubscribes >= 1

        client = redis.Redis.from_url(stack.redis_url)
        wait_for_beat(
            client, WeightSyncBeat, "the restarted server", instance="killme", timeout_s=10
        )
    finally:
        following.stop()
        publisher.close()
        proc.stop()
    log = (tmp_path / "weight_sync.log").read_text()
    assert proc.popen.returncode == 0 and "Traceback" not in log, log[-3000:]
