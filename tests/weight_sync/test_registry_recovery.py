"""Losing the weight registry (docs/architecture.md, guarantee 8): Redis is flushed, and
weight_sync rebuilds the registry from the blob store, never from the warm start.

First a table of stores with holes, torn manifests and rotten blobs, and the version
each arm comes back at; then racing rebuilds; then two real weight_sync processes
with subscriber processes through a FLUSHALL (twice, the second time with the newest
blob rotten); then a trainer process through a FLUSHALL mid-run and a kill -9 after
another one.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import sys
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from rtrl import procs
from rtrl.config import StackSettings
from rtrl.heartbeat import WeightSyncBeat
from rtrl.v1 import weights_pb2
from rtrl.weight_sync import registry
from rtrl.weight_sync.checksum import xxh3_hex
from rtrl.weight_sync.client import Publisher, Subscriber
from rtrl.weight_sync.recovery import RegistryRecovery, recover_store, stored_manifest
from rtrl.weight_sync.registry import Registry
from rtrl.weight_sync.store import LocalBlobStore
from support import subscriber_proc, wait
from support.beats import beats_of
from support.redis_reply import stored
from support.subscriber_proc import weights_checksum
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

KEYFRAME_EVERY = 3  # keyframes v0, v3, v6 of the table's eight versions


# --- which version each arm comes back at -----------------------------------------------


def stock(store: LocalBlobStore, count: int, arm: str = ARM) -> None:
    """Versions 0..count-1 written as the servicer writes them: blob, then manifest."""
    for version in range(count):
        keyframe = version % KEYFRAME_EVERY == 0
        blob = b"blob of v%d " % version * 50
        manifest = weights_pb2.Manifest(
            arm=arm, version=version, parent_version=-1 if keyframe else version - 1, keyframe=keyframe,
            blob_uri=store.write(arm, version, blob), blob_size=len(blob), blob_checksum=xxh3_hex(blob),
            created_ts_ms=1000 + version,
        )  # fmt: skip
        store.write_manifest(arm, version, stored_manifest(manifest))


def manifest_path(store: LocalBlobStore, version: int) -> Path:
    return store.root / ARM / f"{version}.manifest"


def flip_blob(store: LocalBlobStore, version: int) -> None:
    path = store.path(ARM, version)
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    path.write_bytes(bytes(blob))


def cut_manifest_at_a_field(store: LocalBlobStore, version: int) -> None:
    """Drop the last field (created_ts_ms): what is left still parses as a Manifest."""
    checksum, _, body = manifest_path(store, version).read_bytes().partition(b"\n")
    shorter = weights_pb2.Manifest.FromString(body)
    shorter.ClearField("created_ts_ms")
    manifest_path(store, version).write_bytes(checksum + b"\n" + shorter.SerializeToString())


def _blob_then_crash(store: LocalBlobStore) -> None:
    store.write(ARM, 8, b"v8, whose server died before its manifest")


def _manifest_without_blob(store: LocalBlobStore) -> None:
    blob = b"never stored"
    manifest = weights_pb2.Manifest(
        arm=ARM,
        version=8,
        parent_version=7,
        blob_uri=store.path(ARM, 8).as_uri(),
        blob_size=len(blob),
        blob_checksum=xxh3_hex(blob),
    )
    store.write_manifest(ARM, 8, stored_manifest(manifest))


def _garbage_collected(store: LocalBlobStore) -> None:
    for version in (0, 1, 2):
        store.delete(store.path(ARM, version).as_uri())


def _v7_manifest_lost_and_v4_rotten(store: LocalBlobStore) -> None:
    manifest_path(store, 7).unlink()
    flip_blob(store, 4)


def _v4_and_v6_rotten(store: LocalBlobStore) -> None:
    flip_blob(store, 4)
    flip_blob(store, 6)


def _every_keyframe_rotten(store: LocalBlobStore) -> None:
    for version in (0, 3, 6):
        flip_blob(store, version)


RECOVERY_CASES = [
    # (damage, latest, restored versions, lowest next version, versions left out)
    # An intact store comes back whole.
    (lambda s: None, 7, range(8), 8, []),
    # Collected versions (manifest and blob deleted together) are simply not there.
    (_garbage_collected, 7, range(3, 8), 8, []),
    # A blob written by a server that died before the manifest: never committed, its number skipped.
    (_blob_then_crash, 7, range(8), 9, [8]),
    # A manifest whose blob is missing cannot be the latest.
    (_manifest_without_blob, 7, range(8), 9, [8]),
    # The newest delta's blob rotted: back one version, and v7's number is never reused.
    (lambda s: flip_blob(s, 7), 6, range(7), 8, [7]),
    # The newest keyframe rotted: its deltas are useless too; the previous chain's end is latest.
    (lambda s: flip_blob(s, 6), 5, range(6), 8, [6, 7]),
    # A torn manifest (half written by a copy tool) does not parse.
    (
        lambda s: manifest_path(s, 7).write_bytes(manifest_path(s, 7).read_bytes()[:40]),
        6,
        range(7),
        8,
        [7],
    ),
    # A manifest cut at a field boundary parses; its checksum refuses it.
    (lambda s: cut_manifest_at_a_field(s, 7), 6, range(7), 8, [7]),
    # A manifest stored under another version's name is not that version.
    (lambda s: shutil.copyfile(manifest_path(s, 6), manifest_path(s, 7)), 6, range(7), 8, [7]),
    # A delta's manifest lost inside the newest chain: v7 cannot be reached, v6 can.
    (_v7_manifest_lost_and_v4_rotten, 6, range(7), 8, [7]),
    # Both newer chains broken in the middle: only the chain ending at v3 is whole;
    # the older versions' blobs are listed, not read (serving verifies them).
    (_v4_and_v6_rotten, 3, range(4), 8, [4, 5, 6, 7]),
    # Every keyframe rotten: nothing to restore, yet no number below 8 is given out again.
    (_every_keyframe_rotten, -1, [], 8, [0, 1, 2, 3, 4, 5, 6, 7]),
    # A blob gone below the newest chain: that version alone is left out.
    (lambda s: s.path(ARM, 1).unlink(), 7, [0, 2, 3, 4, 5, 6, 7], 8, [1]),
]


@pytest.mark.guarantee(8)
@pytest.mark.parametrize(
    ("damage", "latest", "restored", "lowest_next", "left_out"), RECOVERY_CASES
)
def test_the_newest_complete_version_is_restored(
    tmp_path, damage, latest, restored, lowest_next, left_out
):
    store = LocalBlobStore(tmp_path / "blobs")
    stock(store, 8)
    stock(store, 1, arm="control")
    damage(store)
    recovered = {arm.restored.arm: arm for arm in recover_store(store)}
    treatment = recovered[ARM]
    assert treatment.restored.latest == latest
    assert [m.version for m in treatment.restored.manifests] == list(restored)
    assert treatment.restored.lowest_next == lowest_next
    assert sorted(v for v in treatment.unusable if v not in restored) == left_out
    assert [m.version for m in recovered["control"].restored.manifests] == [0]


# --- racing rebuilds -------------------------------------------------------------------


@pytest.mark.integration
def test_racing_rebuilds_restore_once_and_agree(stack, tmp_path):
    """Two servers (two Redis connections, one store) find the marker gone at once."""
    store = LocalBlobStore(tmp_path / "blobs")
    stock(store, 8)
    flip_blob(store, 7)

    async def race() -> list[int]:
        clients = [aioredis.Redis.from_url(stack.redis_url) for _ in range(2)]
        recoveries = [RegistryRecovery(Registry(client), store) for client in clients]
        try:
            await asyncio.gather(*(recovery.ensure() for recovery in recoveries))
            checked = Registry(clients[0], on_lost=recoveries[0].ensure)
            assert await checked.latest(ARM) == 6
            assert await checked.next_version(ARM, 6) == 8
            assert await checked.newest_keyframe(ARM, 6) == 6
        finally:
            for client in clients:
                await client.aclose()
        return [recovery.rebuilds for recovery in recoveries]

    assert sorted(asyncio.run(race())) == [0, 1]


@pytest.mark.integration
def test_a_rebuild_never_overwrites_a_registry_someone_else_wrote(stack, tmp_path):
    """The late one of two racing rebuilds, and a registry from before the marker existed."""
    store = LocalBlobStore(tmp_path / "blobs")
    stock(store, 8)
    restored = [arm.restored for arm in recover_store(store)]

    async def run() -> None:
        client = aioredis.Redis.from_url(stack.redis_url)
        plain = Registry(client)
        try:
            assert await plain.restore(restored, "first") == "restored"
            await client.set(registry.latest_key(ARM), 9)  # a commit after the first rebuild
            assert await plain.restore(restored, "late") == "raced"
            assert (await client.get(registry.MARKER_KEY), await plain.latest(ARM)) == (b"first", 9)
            await client.delete(registry.MARKER_KEY)
            assert await plain.restore(restored, "adopting") == "adopted"
            assert (await client.get(registry.MARKER_KEY), await plain.latest(ARM)) == (
                b"adopting",
                9,
            )
        finally:
            await client.aclose()

    asyncio.run(run())


# --- a real weight_sync and its subscribers through FLUSHALL -----------------------------


@pytest.mark.integration
def test_an_idle_server_notices_a_flushall_by_itself(server, publisher, policy_weights):
    """No publish, no subscriber, no read: the server's own watch rebuilds the registry."""
    publish_versions(publisher, policy_weights, 2)
    client = redis.Redis.from_url(server.stack.redis_url)
    try:
        client.flushall()
        wait.until(
            lambda: client.get(registry.latest_key(ARM)),
            "the registry to come back at v1",
            ready=lambda latest: latest == b"1",
        )
        assert server.server.recovery.rebuilds == 1
    finally:
        client.close()


def start_weight_sync(
    stack: StackSettings,
    instance: str,
    log_path: Path,
    repo_root: Path,
    poll_interval_s: float = 0.2,
) -> tuple[procs.Proc, str]:
    port = procs.free_port()
    env = {
        "RTRL_REDIS_URL": stack.redis_url,
        "RTRL_STATE_DIR": str(stack.state_dir),
        "RTRL_WEIGHT_SYNC_PORT": str(port),
        "RTRL_WEIGHT_SYNC_KEYFRAME_EVERY": str(KEYFRAME_EVERY),
        "RTRL_WEIGHT_SYNC_POLL_INTERVAL_S": str(poll_interval_s),
        "RTRL_INSTANCE": instance,
        "PYTHONPATH": str(repo_root),
    }
    proc = procs.spawn(
        "weight_sync", [sys.executable, "-m", "rtrl.weight_sync"], log_path, env=env, port=port
    )
    procs.wait_for_port(port)
    return proc, f"127.0.0.1:{port}"


def served(out_path: Path) -> list[tuple[int, str]]:
    """(version, weights checksum) per version a subscriber process yielded."""
    if not out_path.exists():
        return []
    return [
        (int(v), checksum)
        for v, checksum in (line.split() for line in out_path.read_text().splitlines())
    ]


def registry_rebuilds(client: redis.Redis) -> int:
    return sum(beat.registry_rebuilds for beat in beats_of(client, WeightSyncBeat))


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_latest_answers_from_the_registry_not_from_a_head_cached_before_a_flush(
    stack, policy_weights, tmp_path, repo_root
):
    """A publisher's parent_version comes from Latest. The server caches each arm's head
    for its subscribers (here for 5 s); Latest must not answer from that cache, or after
    a rebuild that came back lower the publisher's keyframe is refused as well."""
    client = redis.Redis.from_url(stack.redis_url)
    server, addr = start_weight_sync(
        stack, "ws-cached", tmp_path / "weight_sync.log", repo_root, poll_interval_s=10.0
    )
    publisher = Publisher(
        addr,
        stack.weight_sync_token.get_secret_value(),
        ARM,
        keyframe_every=KEYFRAME_EVERY,
        signing_key=MANIFEST_KEY,
    )
    try:
        versions = publish_versions(publisher, policy_weights, 7)  # the server's cached head: v6
        flip_blob(LocalBlobStore(stack.state_dir / "blobs"), 6)
        client.flushall()
        assert publisher.latest() == 5  # the rebuild, not the cached v6
        versions.append(train_step(versions[-1], 7))
        assert publisher.publish(versions[-1], train_step=len(versions) - 1) == 7
        assert server.alive()
    finally:
        publisher.close()
        server.stop()


@pytest.mark.guarantee(8)
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_flushall_under_live_servers_and_subscribers_keeps_versions_rising(
    stack, policy_weights, tmp_path, repo_root
):
    client = redis.Redis.from_url(stack.redis_url)
    servers = [
        start_weight_sync(stack, f"ws-{name}", tmp_path / f"weight_sync-{name}.log", repo_root)
        for name in "ab"
    ]
    addrs = [addr for _, addr in servers]
    publisher = Publisher(
        addrs[0],
        stack.weight_sync_token.get_secret_value(),
        ARM,
        keyframe_every=KEYFRAME_EVERY,
        signing_key=MANIFEST_KEY,
    )
    outs = [tmp_path / f"worker-{i}.txt" for i in range(2)]
    commands = [subscriber_proc.command(addrs[i], ARM, f"worker-{i}", outs[i]) for i in range(2)]
    workers = [
        procs.spawn(f"worker-{i}", argv, tmp_path / f"worker-{i}.log", env=env)
        for i, (argv, env) in enumerate(commands)
    ]
    following = Following(
        Subscriber(
            addrs[1],
            ARM,
            "worker-in-test",
            token=SUBSCRIBE_TOKEN,
            max_backoff_s=0.5,
            public_keys=MANIFEST_PUBLIC_KEYS,
        )
    )
    try:
        versions = publish_versions(publisher, policy_weights, 5)
        wait.until(
            lambda: [served(out)[-1:] for out in outs],
            "both workers at v4",
            ready=lambda last: last == [[(4, weights_checksum(versions[4]))]] * len(outs),
        )
        assert following.until(4)[-1][0].version == 4

        client.flushall()
        # Nobody publishes: the servers notice on their own, and one of them rebuilds.
        wait.until(
            lambda: client.get(registry.latest_key(ARM)),
            "the registry to come back at v4 without a publish",
            ready=lambda latest: latest == b"4",
        )
        versions.append(train_step(versions[-1], 5))
        assert (
            publisher.publish(versions[-1], train_step=len(versions) - 1) == 5
        )  # a delta on v4, as before the flush
        versions.append(train_step(versions[-1], 6))
        assert (
            publisher.publish(versions[-1], train_step=len(versions) - 1) == 6
        )  # the keyframe due at v6
        manifest, weights = following.until(6)[-1]
        assert_bit_identical(weights, versions[6])

        # Again, with the newest blob rotten on disk: the registry comes back at v5,
        # v6's number is not given out again, and the next version is a keyframe v7.
        flip_blob(LocalBlobStore(stack.state_dir / "blobs"), 6)
        client.flushall()
        wait.until(
            lambda: client.get(registry.latest_key(ARM)),
            "the registry to come back at v5",
            ready=lambda latest: latest == b"5",
        )
        versions.append(train_step(versions[-1], 7))
        assert publisher.publish(versions[-1], train_step=len(versions) - 1) == 7
        manifest, weights = following.next()
        assert (manifest.version, manifest.keyframe) == (7, True)
        assert_bit_identical(weights, versions[7])
        wait.until(
            lambda: [served(out)[-1:] for out in outs],
            "both workers at v7",
            ready=lambda last: last == [[(7, weights_checksum(versions[7]))]] * len(outs),
        )
        for out, worker in zip(outs, workers, strict=True):
            # Each version once, in order, bit for bit: none dropped back to, none reused.
            seen = [v for v, _ in served(out)]
            assert seen == sorted(set(seen)) and seen[-4:] == [4, 5, 6, 7], seen
            assert served(out) == [(v, weights_checksum(versions[v])) for v in seen]
            assert worker.alive()
        assert all(proc.alive() for proc, _ in servers)
        wait.until(
            lambda: registry_rebuilds(client),
            "the heartbeats to count two rebuilds in all",
            ready=lambda rebuilds: rebuilds == 2,
        )
        logs = "".join((tmp_path / f"weight_sync-{name}.log").read_text() for name in "ab")
        assert logs.count("registry rebuilt from") == 2 and "Traceback" not in logs
    finally:
        following.stop()
        publisher.close()
        for worker in workers:
            worker.stop()
        for proc, _ in servers:
            proc.stop()
        client.close()


# --- the trainer through FLUSHALL ----------------------------------------------------------


@pytest.mark.guarantee(8)
@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_trainer_continues_from_the_blob_store_after_flushall(
    stack_settings, stack_env, server, tmp_path, repo_root
):
    """FLUSHALL mid-run: the trainer's next publish is a delta on its last version.
    Then FLUSHALL with the trainer killed and its newest version's blob rotten: the
    restarted trainer resumes from the version before it and publishes above both."""
    import torch

    from rtrl.trainer.loop import TREATMENT
    from support.trainer import (
        install_warm_start,
        produce,
        reward_record,
        sampled_rollouts,
        trainer_env,
        warm_model,
    )

    torch.set_num_threads(1)
    install_warm_start(stack_settings.state_dir)
    rows = sampled_rollouts(warm_model(), 32, seed=5)
    records = [reward_record(*rows[i % len(rows)][:4], reward=(i % 7) / 7) for i in range(3 * 96)]
    token = stack_settings.weight_sync_token.get_secret_value()
    reader = Publisher(server.addr, token, TREATMENT, signing_key=MANIFEST_KEY)
    client = redis.Redis.from_url(stack_settings.redis_url)
    log_path = tmp_path / "trainer.log"
    env = trainer_env(stack_env, server.addr, repo_root)

    def start() -> procs.Proc:
        return procs.spawn("trainer", [sys.executable, "-m", "rtrl.trainer"], log_path, env=env)

    def manifest(version: int) -> weights_pb2.Manifest:
        return weights_pb2.Manifest.FromString(
            stored(client, registry.manifest_key(TREATMENT, version))
        )

    produce(stack_settings.kafka_bootstrap, records[:96])
    trainer = start()
    try:
        wait.until(
            reader.latest,
            "v3 before the flush",
            ready=lambda latest: latest >= 3,
            timeout_s=240,
            watching=[wait.Watched(trainer, log_path)],
        )
        published = reader.latest()
        client.flushall()
        before = reader.latest()
        assert before >= published
        produce(stack_settings.kafka_bootstrap, records[96:192])
        wait.until(
            reader.latest,
            "a version after the flush",
            ready=lambda latest: latest > before + 1,
            timeout_s=240,
            watching=[wait.Watched(trainer, log_path)],
        )
        first_after = manifest(before + 1)
        assert (first_after.keyframe, first_after.parent_version) == (False, before), (
            "the lineage did not continue through the flush"
        )

        trainer.popen.send_signal(signal.SIGKILL)
        trainer.popen.wait()
        newest = reader.latest()
        flip_blob(LocalBlobStore(stack_settings.state_dir / "blobs"), newest)
        client.flushall()
        produce(stack_settings.kafka_bootstrap, records[192:])
        trainer = start()
        wait.until(
            reader.latest,
            "a version after the restart",
            ready=lambda latest: latest > newest,
            timeout_s=240,
            watching=[wait.Watched(trainer, log_path)],
        )
        resumed = manifest(newest + 1)
        assert resumed.keyframe, "the version after a lost number must be a keyframe"
        # What the fleet serves now descends from v(newest - 1), the newest complete version.
        resumed_from = re.compile(
            rf"resumed from (checkpoint at step \d+, treatment|published treatment) v{newest - 1}\b"
        )
        wait.until(
            lambda: resumed_from.search(log_path.read_text()),
            "a resume from the newest complete version",
            timeout_s=240,
            watching=[wait.Watched(trainer, log_path)],
        )
        assert resumed.train_step > manifest(newest - 1).train_step
        trainer.stop()
        log = log_path.read_text()
        assert log.count("as treatment v") == 1, "the warm start was published again"
        assert "Traceback" not in log
        assert server.server.recovery.rebuilds == 2
    finally:
        trainer.stop()
        reader.close()
        client.close()
