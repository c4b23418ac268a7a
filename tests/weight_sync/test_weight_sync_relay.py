"""Relays: a real weight_sync server, relays in front of it, subscribers behind them.

A relay must deliver exactly what the server would (bit-identical weights, the same
keyframe-or-delta paths), cost the server one stream per relay however many workers
sit behind it, refuse publishes, and let its subscribers carry on after it is killed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading

import grpc
import pytest

from rtrl import procs
from rtrl.config import StackSettings
from rtrl.v1 import weights_pb2, weights_pb2_grpc
from rtrl.weight_sync.client import Publisher, Subscriber
from rtrl.weight_sync.relay import Relay, RelaySettings
from rtrl.weight_sync.stream import bearer
from support.weight_sync import (
    MANIFEST_KEY,
    MANIFEST_PUBLIC_KEYS,
    SUBSCRIBE_TOKEN,
    Following,
    assert_bit_identical,
    publish_versions,
    train_step,
)

pytestmark = pytest.mark.integration
ARM = "treatment"


class InProcessRelay:
    """A Relay on its own event loop thread, so the test thread can use the sync clients."""

    def __init__(self, upstream_addr: str, stack: StackSettings, keep_keyframes: int = 2) -> None:
        settings = RelaySettings(
            upstream_addr=upstream_addr,
            port=procs.free_port(),
            arms=(ARM,),
            chunk_bytes=64 * 1024,
            poll_interval_s=0.2,
            keep_keyframes=keep_keyframes,
        )
        self.addr = f"127.0.0.1:{settings.port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

        async def start() -> Relay:
            relay = Relay(settings, stack)  # grpc.aio objects belong to the loop they are made on
            await relay.start()
            return relay

        self.relay = self._run(start())

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    def close(self) -> None:
        self._run(self.relay.stop(grace_s=0))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


@pytest.fixture
def relay(server, stack):
    handle = InProcessRelay(server.addr, stack)
    yield handle
    handle.close()


def test_fan_out_through_a_relay_costs_the_server_one_stream(
    server, stack, publisher, relay, policy_weights
):
    followers = [
        Following(
            Subscriber(
                relay.addr,
                ARM,
                f"worker-{i}",
                token=SUBSCRIBE_TOKEN,
                public_keys=MANIFEST_PUBLIC_KEYS,
            )
        )
        for i in range(3)
    ]
    try:
        versions = publish_versions(publisher, policy_weights, 4)
        for following in followers:
            received = following.until(3)
            assert [m.version for m, _ in received] == [0, 1, 2, 3]
            assert [m.keyframe for m, _ in received] == [True, False, False, False]
            assert_bit_identical(received[-1][1], versions[3])
    finally:
        for following in followers:
            following.stop()
    upstream_sent = server.server.service.bytes_sent
    relay_sent = relay.relay.service.bytes_sent
    assert upstream_sent == relay.relay.status()["bytes_received"]
    assert relay_sent == 3 * upstream_sent


def test_a_late_subscriber_of_a_relay_gets_a_keyframe_path_and_one_holding_a_version_gets_deltas(
    server, stack, publisher, relay, policy_weights
):
    versions = publish_versions(publisher, policy_weights, 3)
    early = Following(
        Subscriber(
            relay.addr, ARM, "early", token=SUBSCRIBE_TOKEN, public_keys=MANIFEST_PUBLIC_KEYS
        )
    )
    try:
        assert early.until(2)[-1][0].version == 2
    finally:
        early.stop()
    late = Following(
        Subscriber(relay.addr, ARM, "late", token=SUBSCRIBE_TOKEN, public_keys=MANIFEST_PUBLIC_KEYS)
    )
    holding = Following(
        Subscriber(
            relay.addr, ARM, "holding", token=SUBSCRIBE_TOKEN, public_keys=MANIFEST_PUBLIC_KEYS
        ),
        have_version=1,
        weights=versions[1],
    )
    try:
        assert [(m.version, m.keyframe) for m, _ in late.until(2)] == [
            (0, True),
            (1, False),
            (2, False),
        ]
        received = holding.until(2)
        assert [(m.version, m.keyframe) for m, _ in received] == [(2, False)]
        assert_bit_identical(received[-1][1], versions[2])
    finally:
        late.stop()
        holding.stop()


def test_relays_stack_and_prune_to_their_newest_keyframes(server, stack, policy_weights):
    publisher = Publisher(
        server.addr,
        stack.weight_sync_token.get_secret_value(),
        ARM,
        keyframe_every=3,
        signing_key=MANIFEST_KEY,
    )
    near = InProcessRelay(server.addr, stack, keep_keyframes=1)
    far = InProcessRelay(near.addr, stack, keep_keyframes=1)
    following = Following(
        Subscriber(
            far.addr, ARM, "far-worker", token=SUBSCRIBE_TOKEN, public_keys=MANIFEST_PUBLIC_KEYS
        )
    )
    try:
        versions = publish_versions(publisher, policy_weights, 8)  # keyframes at 0, 3, 6
        received = following.until(7)
        assert_bit_identical(received[-1][1], versions[7])
        assert sorted(near.relay.cache._versions[ARM]) == [6, 7]
        late = Following(
            Subscriber(
                far.addr, ARM, "late", token=SUBSCRIBE_TOKEN, public_keys=MANIFEST_PUBLIC_KEYS
            )
        )
        try:
            assert [(m.version, m.keyframe) for m, _ in late.until(7)] == [(6, True), (7, False)]
        finally:
            late.stop()
    finally:
        following.stop()
        far.close()
        near.close()
        publisher.close()


def test_relay_refuses_publishes_and_unknown_tokens(relay, stack, policy_weights):
    stub = weights_pb2_grpc.WeightSyncStub(grpc.insecure_channel(relay.addr))
    chunk = weights_pb2.PublishChunk(
        manifest=weights_pb2.Manifest(arm=ARM, keyframe=True, parent_version=-1)
    )
    with pytest.raises(grpc.RpcError) as raised:
        stub.Publish(
            iter([chunk]), metadata=bearer(stack.weight_sync_token.get_secret_value()), timeout=10
        )
    assert raised.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as raised:
        list(
            stub.Subscribe(
                weights_pb2.SubscribeRequest(arm=ARM), metadata=bearer("not-a-token"), timeout=10
            )
        )
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_subscribers_carry_on_after_their_relay_is_killed(
    server, stack, publisher, repo_root, tmp_path, policy_weights
):
    port = procs.free_port()
    env = {
        "RTRL_REDIS_URL": stack.redis_url,
        "RTRL_WEIGHT_SYNC_RELAY_UPSTREAM_ADDR": server.addr,
        "RTRL_WEIGHT_SYNC_RELAY_PORT": str(port),
        "RTRL_WEIGHT_SYNC_RELAY_ARMS": f'["{ARM}"]',
        "PYTHONPATH": str(repo_root),
    }

    def start() -> procs.Proc:
        proc = procs.spawn(
            "relay",
            [sys.executable, "-m", "rtrl.weight_sync.relay"],
            tmp_path / "relay.log",
            env=env,
            port=port,
        )
        procs.wait_for_port(port)
        return proc

    proc = start()
    subscriber = Subscriber(
        f"127.0.0.1:{port}",
        ARM,
        "worker-r",
        token=SUBSCRIBE_TOKEN,
        max_backoff_s=0.5,
        public_keys=MANIFEST_PUBLIC_KEYS,
    )
    following = Following(subscriber)
    try:
        versions = publish_versions(publisher, policy_weights, 2)
        assert following.until(1)[-1][0].version == 1
        os.killpg(proc.pid, signal.SIGKILL)
        proc.popen.wait()
        versions.append(train_step(versions[-1], 9))
        assert publisher.publish(versions[-1], train_step=len(versions) - 1) == 2
        proc = start()
        manifest, weights = following.next()
        # The restarted relay holds the keyframe and both deltas; the worker held v1, so it gets only v2.
        assert (manifest.version, manifest.keyframe) == (2, False)
        assert_bit_identical(weights, versions[2])
        assert subscriber.resubscribes >= 1
    finally:
        following.stop()
        proc.stop()
    log = (tmp_path / "relay.log").read_text()
    assert proc.popen.returncode == 0 and "Traceback" not in log, log[-3000:]
