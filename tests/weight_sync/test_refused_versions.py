"""A refused version is fetched once, not again and again (guarantee 7, the cost of refusing).

Whoever can write Redis can point an arm's latest at a manifest the worker must refuse
(another arm's, a forgery, an old one replayed) and leave it there. Refusing is not
enough: a worker that answers a refusal by starting over from a keyframe is sent the same
version again at once, about ten times a second, every worker, until Redis is repaired.
Here the attack is made through the real registry against a following worker, and the
tests count what weight_sync streams while the bad pointer stands and until the trainer's
next version is served.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest
import redis
import torch

from rtrl.inference.weights import WeightFollower
from rtrl.v1 import weights_pb2
from rtrl.weight_sync import registry
from rtrl.weight_sync.client import Publisher, RefusalBackoff, latest_version
from rtrl.weight_sync.servicer import WeightSyncService
from support import wait
from support.redis_reply import stored
from support.weight_sync import (
    MANIFEST_KEY,
    MANIFEST_PUBLIC_KEYS,
    SUBSCRIBE_TOKEN,
    publish_versions,
    train_step,
)

TREATMENT, CONTROL = "treatment", "control"
# How long the bad pointer stands before the trainer publishes again. The window is what
# is tested: a worker that fetches the refused version again does so several times in it.
BAD_POINTER_WINDOW_S = 2.0


def _point_latest_at(client: redis.Redis, arm: str, version: int, raw_manifest: bytes) -> None:
    """What one with write access to Redis can do: make a manifest the arm's latest."""
    client.set(registry.manifest_key(arm, version), raw_manifest)
    if weights_pb2.Manifest.FromString(raw_manifest).keyframe:
        client.zadd(registry.keyframes_key(arm), {str(version): version})
    client.set(registry.latest_key(arm), version)
    client.publish(registry.published_channel(arm), str(version))


def _controls_as_is(client: redis.Redis) -> bytes:
    """Control's manifest, byte for byte: signed by the trainer, for the other arm."""
    return stored(client, registry.manifest_key(CONTROL, 0))


def _controls_relabelled(client: redis.Redis) -> bytes:
    """Control's manifest relabelled as treatment's: its signature no longer verifies."""
    manifest = weights_pb2.Manifest.FromString(_controls_as_is(client))
    manifest.arm, manifest.version = TREATMENT, 3
    return manifest.SerializeToString()


def _treatments_first_replayed(client: redis.Redis) -> bytes:
    """Treatment's v0, signed by the trainer, replayed as v3: a rollback."""
    manifest = weights_pb2.Manifest.FromString(stored(client, registry.manifest_key(TREATMENT, 0)))
    manifest.version = 3
    return manifest.SerializeToString()


def _treatments_latest_replayed_on_itself(client: redis.Redis) -> bytes:
    """Treatment's v2, a delta the trainer signed, replayed as v3 on top of v2 (the parent
    is weight_sync's to assign, not signed): it passes every check but decoding."""
    manifest = weights_pb2.Manifest.FromString(stored(client, registry.manifest_key(TREATMENT, 2)))
    assert not manifest.keyframe
    manifest.version, manifest.parent_version = 3, 2
    return manifest.SerializeToString()


class _Served:
    """The versions a worker staged: what it serves."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.versions: list[int] = []

    def stage(self, version: int, weights: dict[str, torch.Tensor]) -> bool:
        with self._lock:
            self.versions.append(version)
        return True

    def newest(self) -> int:
        with self._lock:
            return self.versions[-1] if self.versions else -1


@dataclass(repr=False)
class _Attacked:
    """Treatment at v2 (steps 0..2) and control at v0 (step 50), a worker following
    treatment and serving v2, and the server's count of versions streamed so far."""

    client: redis.Redis
    server_addr: str
    trainer: dict[str, Publisher]
    versions: list[dict[str, torch.Tensor]]
    served: _Served
    follower: WeightFollower
    service: WeightSyncService
    sent_before: int

    def streamed(self) -> int:
        """Versions weight_sync streamed since the worker served v2."""
        return self.service.versions_sent - self.sent_before

    def publish_next(self) -> None:
        """The trainer's next version (a keyframe: the registry moved under it), served at once."""
        self.versions.append(train_step(self.versions[-1], 3))
        assert self.trainer[TREATMENT].publish(self.versions[-1], train_step=3) == 4
        wait.until(self.served.newest, "the worker to serve v4", ready=lambda newest: newest == 4)


@pytest.fixture
def attacked(server, stack, policy_weights):
    token = stack.weight_sync_token.get_secret_value()
    trainer = {
        arm: Publisher(server.addr, token, arm, keyframe_every=20, signing_key=MANIFEST_KEY)
        for arm in (TREATMENT, CONTROL)
    }
    # Control trained further than treatment: its version would pass a rollback check.
    noise = {name: tensor.clone().normal_() for name, tensor in policy_weights.items()}
    trainer[CONTROL].publish(noise, train_step=50)
    versions = publish_versions(trainer[TREATMENT], policy_weights, 3)  # v0..v2, steps 0..2
    served = _Served()
    follower = WeightFollower(
        served.stage, server.addr, SUBSCRIBE_TOKEN, TREATMENT, "worker",
        public_keys=MANIFEST_PUBLIC_KEYS, refusal_backoff=RefusalBackoff(jitter=0),
    ).start()  # fmt: skip
    try:
        wait.until(served.newest, "the worker to serve v2", ready=lambda newest: newest == 2)
        service = server.running.service
        yield _Attacked(
            redis.Redis.from_url(stack.redis_url), server.addr, trainer, versions, served, follower,
            service, service.versions_sent,
        )  # fmt: skip
    finally:
        follower.stop()
        for publisher in trainer.values():
            publisher.close()


@pytest.mark.guarantee(7)
@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "bad_manifest",
    [_controls_relabelled, _treatments_first_replayed],
    ids=["control's relabelled", "a rollback"],
)
def test_a_worker_fetches_a_refused_version_once_and_takes_the_next_valid_one(
    attacked, bad_manifest
):
    _point_latest_at(attacked.client, TREATMENT, 3, bad_manifest(attacked.client))
    wait.until(lambda: attacked.follower.refused, "the worker to refuse the bad v3")
    time.sleep(BAD_POINTER_WINDOW_S)  # the bad pointer standing: the window under test
    assert attacked.served.newest() == 2, "the worker must keep serving what it holds"
    streamed = attacked.streamed()
    assert streamed == 1, f"v3 was streamed {streamed} times while the bad pointer stood"

    attacked.publish_next()
    assert attacked.streamed() == 2  # v3 once, then v4
    assert attacked.follower.refused == 1, "a refused version is counted once"
    assert attacked.served.versions == [2, 4]


@pytest.mark.guarantee(7)
@pytest.mark.integration
@pytest.mark.timeout(120)
def test_weight_sync_streams_no_manifest_filed_under_another_arm_or_version(attacked, caplog):
    """Control's manifest as it is, signed for control, filed as treatment's v3: weight_sync
    never wrote that, and streams nothing of it (streamed, it would say v0 where the
    registry says v3, and the stream would send it round and round)."""
    _point_latest_at(attacked.client, TREATMENT, 3, _controls_as_is(attacked.client))
    wait.until(
        lambda: latest_version(attacked.server_addr, SUBSCRIBE_TOKEN, TREATMENT),
        "weight_sync to see treatment's latest at v3",
        ready=lambda latest: latest == 3,
    )
    time.sleep(BAD_POINTER_WINDOW_S)  # the bad pointer standing: the window under test
    assert attacked.served.newest() == 2, "the worker must keep serving what it holds"
    streamed = attacked.streamed()
    assert streamed == 0, f"control's v0 was streamed {streamed} times while the bad pointer stood"
    assert "the manifest filed as treatment v3 is control v0: not streamed" in caplog.text

    attacked.publish_next()
    assert attacked.streamed() == 1
    assert attacked.served.versions == [2, 4]


@pytest.mark.guarantee(7)
@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_worker_reconnecting_while_the_bad_pointer_stands_does_not_fetch_it_again(
    attacked, server
):
    """weight_sync restarts under a worker that refused v3: the worker subscribes again
    from after v3, not from what it serves, so nothing is streamed until v4."""
    _point_latest_at(attacked.client, TREATMENT, 3, _controls_relabelled(attacked.client))
    wait.until(lambda: attacked.follower.refused, "the worker to refuse the bad v3")
    server.stop()
    server.start()
    attacked.service, attacked.sent_before = server.running.service, 0
    wait.until(
        lambda: attacked.service.subscribers, "the worker to subscribe to the restarted weight_sync"
    )
    time.sleep(BAD_POINTER_WINDOW_S)  # the bad pointer standing: the window under test
    streamed = attacked.streamed()
    assert streamed == 0, f"v3 was streamed {streamed} times after the worker reconnected"

    attacked.publish_next()
    assert attacked.streamed() == 1
    assert attacked.follower.refused == 1
    assert attacked.served.versions == [2, 4]


@pytest.mark.guarantee(7)
@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_version_that_does_not_decode_is_fetched_again_once_from_a_keyframe_then_refused(
    attacked,
):
    """The worker's own copy may be what is wrong, so a version that does not decode is
    worth one fresh start from a keyframe (after a pause); failing again, it is refused."""
    _point_latest_at(
        attacked.client, TREATMENT, 3, _treatments_latest_replayed_on_itself(attacked.client)
    )
    wait.until(lambda: attacked.follower.refused, "the worker to refuse the undecodable v3")
    time.sleep(BAD_POINTER_WINDOW_S)  # the bad pointer standing: the window under test
    assert attacked.served.newest() == 2, "the worker must keep serving what it holds"
    streamed = attacked.streamed()
    # v3, then the fresh start: keyframe v0, v1, v2 and v3 again.
    assert streamed == 5, f"{streamed} versions were streamed while the bad pointer stood"

    attacked.publish_next()
    assert attacked.streamed() == 6
    assert attacked.follower.refused == 1
    assert attacked.served.versions == [2, 4]


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_follower_starting_over_takes_the_next_version_and_refuses_nothing(
    server, publisher, policy_weights
):
    """A follower whose subscriber failed starts another from a keyframe: the versions on
    the way from it to the next one are older than what the worker took, by nature, and
    are no rollback: nothing is refused and the next version is served."""
    served, failed_once = _Served(), threading.Event()

    def stage(version: int, weights: dict[str, torch.Tensor]) -> bool:
        if version == 3 and not failed_once.is_set():
            failed_once.set()
            raise RuntimeError("the engine could not stage v3 this time")
        return served.stage(version, weights)

    versions = publish_versions(publisher, policy_weights, 3)  # v0..v2, steps 0..2
    follower = WeightFollower(
        stage, server.addr, SUBSCRIBE_TOKEN, TREATMENT, "worker", retry_s=0.1,
        public_keys=MANIFEST_PUBLIC_KEYS,
    ).start()  # fmt: skip
    try:
        wait.until(served.newest, "the worker to serve v2", ready=lambda newest: newest == 2)
        versions.append(train_step(versions[-1], 3))
        assert publisher.publish(versions[-1], train_step=3) == 3
        wait.until(served.newest, "the worker to serve v3", ready=lambda newest: newest == 3)
        assert failed_once.is_set() and follower.refused == 0
        assert served.versions == [2, 3]
    finally:
        follower.stop()
