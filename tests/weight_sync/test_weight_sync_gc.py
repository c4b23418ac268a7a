"""Garbage collection of old weight versions: the plan as a table of cases and a
property, then the runtime on a real Redis with blobs on disk, behind a real server.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import cast

import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st

from rtrl import procs
from rtrl.config import StackSettings
from rtrl.v1 import weights_pb2
from rtrl.weight_sync import gc, registry
from rtrl.weight_sync.client import Publisher, Subscriber
from rtrl.weight_sync.config import WeightSyncSettings
from rtrl.weight_sync.registry import Registry
from rtrl.weight_sync.store import LocalBlobStore
from support import wait

# The in-process server and subscriber helpers of the weight_sync tests.
from support.weight_sync import (
    MANIFEST_KEY,
    MANIFEST_PUBLIC_KEYS,
    SUBSCRIBE_TOKEN,
    Following,
    InProcessServer,
    assert_bit_identical,
    publish_versions,
)


def uri(version: int) -> str:
    return f"file:///blobs/treatment/{version}.blob"


def view(
    latest: int, keyframes: tuple[int, ...], manifests: range | list[int] | None = None
) -> gc.ArmView:
    stored = range(latest + 1) if manifests is None else manifests
    return gc.ArmView("treatment", latest, keyframes, {v: uri(v) for v in stored})


def collected(
    keep_from: int | None, versions: Sequence[int] = (), missing: tuple[int, ...] = ()
) -> gc.ArmPlan:
    return gc.ArmPlan(
        "treatment", keep_from, tuple(versions), tuple(uri(v) for v in versions if v not in missing)
    )


@pytest.mark.parametrize(
    ("arm_view", "keep_keyframes", "expected"),
    [
        # an arm nothing was published to
        (view(-1, ()), 2, collected(None)),
        # the control arm, pinned at its warm start: its only keyframe stays
        (view(0, (0,)), 2, collected(0)),
        (view(0, (0,)), 1, collected(0)),
        # one keyframe and its deltas are the only path to latest
        (view(7, (0,)), 1, collected(0)),
        # fewer keyframes than kept
        (view(8, (0, 5)), 2, collected(0)),
        # the newest two of three keyframes, and everything after the older one
        (view(12, (0, 5, 10)), 2, collected(5, range(5))),
        # latest is itself the kept keyframe: every older version goes
        (view(10, (0, 5, 10)), 1, collected(10, range(10))),
        # a keyframe above latest (registry read mid-commit) is not counted
        (view(14, (0, 5, 10, 15)), 1, collected(10, range(10))),
        # a stale publisher's resent keyframe makes the cadence irregular
        (view(6, (0, 3, 4)), 2, collected(3, range(3))),
        # already collected down to the oldest kept keyframe: nothing more
        (view(17, (10, 15), range(10, 18)), 2, collected(10)),
        # a keyframe entry whose manifest is already gone: the entry goes, no blob to delete
        (view(12, (0, 5, 10), range(1, 13)), 2, collected(5, range(5), missing=(0,))),
        # the integration test's shape: 30 versions, a keyframe every 5, keep 2
        (view(29, (0, 5, 10, 15, 20, 25)), 2, collected(20, range(20))),
        (view(29, (0, 5, 10, 15, 20, 25)), 3, collected(15, range(15))),
    ],
)
def test_plan(arm_view, keep_keyframes, expected):
    assert gc.plan(arm_view, keep_keyframes) == expected


@given(
    latest=st.integers(0, 60),
    gaps=st.lists(st.integers(1, 12), max_size=10),
    keep_keyframes=st.integers(1, 4),
)
def test_plan_keeps_latest_and_its_path(latest, gaps, keep_keyframes):
    keyframes = [0]
    for gap in gaps:
        keyframes.append(keyframes[-1] + gap)
    keyframes = [k for k in keyframes if k <= latest]
    arm_plan = gc.plan(view(latest, tuple(keyframes)), keep_keyframes)
    kept = sorted(set(range(latest + 1)) - set(arm_plan.versions))
    assert latest in kept
    assert set(range(keyframes[-1], latest + 1)) <= set(kept)  # the newest keyframe and its deltas
    assert [k for k in keyframes if k in kept] == keyframes[-keep_keyframes:]
    assert kept == list(range(kept[0], latest + 1))  # only a prefix of history goes
    assert arm_plan.blob_uris == tuple(uri(v) for v in arm_plan.versions)


def start_server(stack: StackSettings, **settings) -> InProcessServer:
    server = InProcessServer(
        WeightSyncSettings(
            port=procs.free_port(), chunk_bytes=64 * 1024, poll_interval_s=0.2, **settings
        ),
        stack,
    )
    server.start()
    return server


def stored_versions(stack: StackSettings, arm: str) -> tuple[list[int], list[int], list[int]]:
    """(manifests, keyframe entries, blobs) of the arm, as Redis and the disk hold them."""
    client = redis.Redis.from_url(stack.redis_url)
    manifests = sorted(
        int(k.decode().rsplit(":", 1)[1]) for k in client.scan_iter(f"rtrl:ws:{arm}:manifest:*")
    )
    # Without withscores, zrange gives the members only (bytes: this client does not decode).
    members = cast("list[bytes]", client.zrange(registry.keyframes_key(arm), 0, -1))
    keyframes = sorted(int(k) for k in members)
    client.close()
    blobs = sorted(int(p.stem) for p in (stack.state_dir / "blobs" / arm).glob("*.blob"))
    return manifests, keyframes, blobs


@pytest.mark.integration
def test_collection_deletes_exactly_the_plan_and_subscribers_still_sync(stack, policy_weights):
    server = start_server(stack, keyframe_every=5, keep_keyframes=2, gc_interval_s=0)
    token = stack.weight_sync_token.get_secret_value()
    publisher = Publisher(
        server.addr, token, "treatment", keyframe_every=5, signing_key=MANIFEST_KEY
    )
    control = Publisher(server.addr, token, "control", keyframe_every=5, signing_key=MANIFEST_KEY)
    try:
        assert control.publish(policy_weights) == 0
        versions = publish_versions(publisher, policy_weights, 30)
        assert stored_versions(stack, "treatment") == (
            list(range(30)),
            [0, 5, 10, 15, 20, 25],
            list(range(30)),
        )

        plans = server._run(server.running.collect_garbage())
        assert [(p.arm, p.keep_from, p.versions) for p in plans] == [
            ("control", 0, ()),
            ("treatment", 20, tuple(range(20))),
        ]
        assert plans[1].blob_uris == tuple(
            (stack.state_dir / "blobs" / "treatment" / f"{v}.blob").resolve().as_uri()
            for v in range(20)
        )
        assert stored_versions(stack, "treatment") == (
            list(range(20, 30)),
            [20, 25],
            list(range(20, 30)),
        )
        assert stored_versions(stack, "control") == ([0], [0], [0])
        assert (
            redis.Redis.from_url(stack.redis_url).exists(
                registry.unreferenced_blobs_key("treatment")
            )
            == 0
        )
        again = server._run(server.running.collect_garbage())
        assert [p.versions for p in again] == [(), ()]

        # From scratch: the newest keyframe and the deltas after it.
        following = Following(
            Subscriber(
                server.addr,
                "treatment",
                "fresh",
                token=SUBSCRIBE_TOKEN,
                public_keys=MANIFEST_PUBLIC_KEYS,
            )
        )
        try:
            received = following.until(29)
        finally:
            following.stop()
        assert [(m.version, m.keyframe) for m, _ in received] == [
            (25, True),
            (26, False),
            (27, False),
            (28, False),
            (29, False),
        ]
        assert_bit_identical(received[-1][1], versions[29])

        # Holding a recent version: deltas only.
        following = Following(
            Subscriber(
                server.addr,
                "treatment",
                "recent",
                token=SUBSCRIBE_TOKEN,
                public_keys=MANIFEST_PUBLIC_KEYS,
            ),
            have_version=26,
            weights=versions[26],
        )
        try:
            received = following.until(29)
        finally:
            following.stop()
        assert [(m.version, m.keyframe) for m, _ in received] == [
            (27, False),
            (28, False),
            (29, False),
        ]
        assert_bit_identical(received[-1][1], versions[29])

        # The pinned control arm still serves its v0.
        following = Following(
            Subscriber(
                server.addr,
                "control",
                "control-worker",
                token=SUBSCRIBE_TOKEN,
                public_keys=MANIFEST_PUBLIC_KEYS,
            )
        )
        try:
            manifest, weights = following.next()
        finally:
            following.stop()
        assert (manifest.version, manifest.keyframe) == (0, True)
        assert_bit_identical(weights, policy_weights)
    finally:
        publisher.close()
        control.close()
        server.close()


@pytest.mark.integration
def test_periodic_collection_runs_beside_publishing(stack, policy_weights):
    server = start_server(stack, keyframe_every=2, keep_keyframes=1, gc_interval_s=0.05)
    publisher = Publisher(
        server.addr,
        stack.weight_sync_token.get_secret_value(),
        "treatment",
        keyframe_every=2,
        signing_key=MANIFEST_KEY,
    )
    following = Following(
        Subscriber(
            server.addr,
            "treatment",
            "follower",
            max_backoff_s=0.2,
            token=SUBSCRIBE_TOKEN,
            public_keys=MANIFEST_PUBLIC_KEYS,
        )
    )
    try:
        versions = publish_versions(publisher, policy_weights, 9)  # keyframes v0, v2, v4, v6, v8
        assert following.until(8)[-1][0].version == 8
        wait.until(
            lambda: stored_versions(stack, "treatment"),
            "only v8 left in the registry, the keyframes and the blob store",
            ready=lambda stored: stored == ([8], [8], [8]),
            timeout_s=10,
        )
        assert server.running.versions_collected == 8
        fresh = Following(
            Subscriber(
                server.addr,
                "treatment",
                "fresh",
                token=SUBSCRIBE_TOKEN,
                public_keys=MANIFEST_PUBLIC_KEYS,
            )
        )
        try:
            manifest, weights = fresh.next()
        finally:
            fresh.stop()
        assert manifest.version == 8
        assert_bit_identical(weights, versions[8])
    finally:
        following.stop()
        publisher.close()
        server.close()


async def commit_versions(
    versions: Registry, store: LocalBlobStore, count: int, keyframe_every: int
) -> None:
    """Versions 0..count-1 of arm "treatment" straight into the registry, with tiny blobs."""
    for version in range(count):
        keyframe = version % keyframe_every == 0
        manifest = weights_pb2.Manifest(
            arm="treatment", version=version, parent_version=-1 if keyframe else version - 1, keyframe=keyframe,
            blob_uri=store.write("treatment", version, b"blob %d" % version),
        )  # fmt: skip
        assert await versions.commit(manifest)


@pytest.mark.integration
def test_view_of_a_long_history(stack):
    store = LocalBlobStore(stack.state_dir / "blobs")

    async def run() -> gc.ArmView:
        client = aioredis.Redis.from_url(stack.redis_url)
        versions = Registry(client)
        await commit_versions(versions, store, 600, keyframe_every=290)
        arm_view = await gc.view_of(versions, "treatment")
        await client.aclose()
        return arm_view

    arm_view = asyncio.run(run())
    assert (arm_view.latest, arm_view.keyframes) == (599, (0, 290, 580))
    # Every manifest below the newest keyframe, read 256 at a time.
    assert arm_view.blob_uris == {v: store.path("treatment", v).as_uri() for v in range(580)}


@pytest.mark.integration
def test_collection_cut_short_is_finished_by_the_next(stack, caplog):
    """Manifests deleted, blobs not yet: the next collection deletes the blobs."""
    store = LocalBlobStore(stack.state_dir / "blobs")

    async def run() -> None:
        client = aioredis.Redis.from_url(stack.redis_url)
        versions = Registry(client)
        await commit_versions(versions, store, 6, keyframe_every=3)
        arm_plan = gc.plan(await gc.view_of(versions, "treatment"), keep_keyframes=1)
        assert arm_plan.versions == (0, 1, 2)
        # The first collection dies after its Redis transaction.
        await versions.forget(
            "treatment",
            list(arm_plan.versions),
            [*arm_plan.blob_uris, "s3://old-bucket/treatment/0.blob"],
        )
        assert stored_versions(stack, "treatment") == ([3, 4, 5], [3], list(range(6)))

        with caplog.at_level(logging.WARNING, logger="weight_sync"):
            plans = await gc.collect(versions, store, keep_keyframes=1)
        assert [p.versions for p in plans] == [()]
        assert stored_versions(stack, "treatment") == ([3, 4, 5], [3], [3, 4, 5])
        assert await versions.unreferenced_blobs("treatment") == []
        assert "not deleting s3://old-bucket/treatment/0.blob" in caplog.text
        await client.aclose()

    asyncio.run(run())
