"""The version registry in Redis: latest version per arm, manifests, keyframes.

Keys (per arm): ``rtrl:ws:<arm>:latest`` (int), ``rtrl:ws:<arm>:manifest:<v>``
(serialized Manifest), ``rtrl:ws:<arm>:keyframes`` (sorted set of keyframe
versions), ``rtrl:ws:<arm>:unreferenced_blobs`` (set of URIs of blobs whose
manifests garbage collection deleted, until the blobs are deleted too);
``rtrl:ws:arms`` is the set of arms. Every commit is announced on the pub/sub
channel ``rtrl:ws:<arm>:published`` with the version as the message.

``rtrl:ws:registry`` marks an initialized registry: weight_sync writes it when it
creates or rebuilds the registry, so its absence means Redis lost the registry
(FLUSHALL, a restart without persistence). A Registry given ``on_lost`` reads the
marker in the same transaction as every head and manifest read and every commit,
and calls on_lost (which rebuilds it from the blob store, recovery.py) before
answering. ``rtrl:ws:<arm>:lowest_next``, set only by a rebuild, is the lowest
version number the arm's next commit may take: numbers the blob store holds
files of but that could not be restored are never given out again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from rtrl.v1 import weights_pb2

PREFIX = "rtrl:ws:"
ARMS_KEY = f"{PREFIX}arms"
MARKER_KEY = f"{PREFIX}registry"
PUBLISHED_PATTERN = f"{PREFIX}*:published"


class RegistryLost(Exception):
    """The registry's marker is gone, and stayed gone through a rebuild."""


def latest_key(arm: str) -> str:
    return f"{PREFIX}{arm}:latest"


def manifest_key(arm: str, version: int) -> str:
    return f"{PREFIX}{arm}:manifest:{version}"


def keyframes_key(arm: str) -> str:
    return f"{PREFIX}{arm}:keyframes"


def lowest_next_key(arm: str) -> str:
    return f"{PREFIX}{arm}:lowest_next"


def unreferenced_blobs_key(arm: str) -> str:
    return f"{PREFIX}{arm}:unreferenced_blobs"


def published_channel(arm: str) -> str:
    return f"{PREFIX}{arm}:published"


def arm_of_channel(channel: str) -> str:
    return channel.removeprefix(PREFIX).removesuffix(":published")


class Registry:
    def __init__(
        self, client: aioredis.Redis, on_lost: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        """on_lost: called when the marker is found missing, to rebuild the registry; without
        it the marker is not checked (a plain view of the keys, for tools and tests)."""
        self._redis = client
        self._on_lost = on_lost

    async def _read(self, queue: Callable[[aioredis.client.Pipeline], object]) -> list:
        """The results of the reads ``queue`` adds to a transaction, taken together with
        the marker: a lost registry is rebuilt before anything read from it is answered."""
        for _ in range(2):
            async with self._redis.pipeline(transaction=True) as pipe:
                if self._on_lost is not None:
                    pipe.exists(MARKER_KEY)
                queue(pipe)
                results = await pipe.execute()
            if self._on_lost is None:
                return results
            if results[0]:
                return results[1:]
            await self._on_lost()
        raise RegistryLost("the registry was lost again while it was being rebuilt")

    async def marked(self) -> bool:
        return bool(await self._redis.exists(MARKER_KEY))

    async def latest(self, arm: str) -> int:
        """The newest committed version of the arm, -1 if none."""
        (raw,) = await self._read(lambda pipe: pipe.get(latest_key(arm)))
        return -1 if raw is None else int(raw)

    async def next_version(self, arm: str, latest: int) -> int:
        """The version number a commit on top of ``latest`` takes."""
        (raw,) = await self._read(lambda pipe: pipe.get(lowest_next_key(arm)))
        return latest + 1 if raw is None else max(latest + 1, int(raw))

    async def latest_by_arm(self) -> dict[str, int]:
        arms = sorted(
            a.decode() if isinstance(a, bytes) else a for a in await self._redis.smembers(ARMS_KEY)
        )
        values = await self._redis.mget([latest_key(a) for a in arms]) if arms else []
        return {arm: int(v) for arm, v in zip(arms, values, strict=True) if v is not None}

    async def arms(self) -> list[str]:
        return sorted(
            a.decode() if isinstance(a, bytes) else a for a in await self._redis.smembers(ARMS_KEY)
        )

    async def latest_and_keyframes(self, arm: str) -> tuple[int, list[int]]:
        """The latest version and every keyframe version (ascending), read together."""

        def queue(pipe: aioredis.client.Pipeline) -> None:
            pipe.get(latest_key(arm))
            pipe.zrange(keyframes_key(arm), 0, -1)

        raw, keyframes = await self._read(queue)
        return (-1 if raw is None else int(raw)), sorted(int(k) for k in keyframes)

    async def newest_keyframe(self, arm: str, at_most: int) -> int | None:
        (found,) = await self._read(
            lambda pipe: pipe.zrevrangebyscore(keyframes_key(arm), at_most, "-inf", start=0, num=1)
        )
        return int(found[0]) if found else None

    async def manifest(self, arm: str, version: int) -> weights_pb2.Manifest | None:
        (raw,) = await self._read(lambda pipe: pipe.get(manifest_key(arm, version)))
        return None if raw is None else weights_pb2.Manifest.FromString(raw)

    async def manifests(self, arm: str, first: int, last: int) -> dict[int, weights_pb2.Manifest]:
        """The manifests of versions first..last that exist."""
        if last < first:
            return {}
        versions = range(first, last + 1)
        (raws,) = await self._read(lambda pipe: pipe.mget([manifest_key(arm, v) for v in versions]))
        return {
            v: weights_pb2.Manifest.FromString(raw)
            for v, raw in zip(versions, raws, strict=True)
            if raw is not None
        }

    async def commit(
        self, manifest: weights_pb2.Manifest, expected_latest: int | None = None
    ) -> bool:
        """Make manifest.version the latest of its arm, if the latest is still
        expected_latest (version - 1 unless given: a rebuild may have set lowest_next).

        Atomic (WATCH/MULTI): of two servers racing for one version, one commits and
        the other gets False. A commit never lands on a lost registry: it rebuilds it
        first, and a rebuild that restored this very manifest (it was stored beside
        its blob before this call) counts as the commit.
        """
        arm, version = manifest.arm, manifest.version
        expected = version - 1 if expected_latest is None else expected_latest
        serialized = manifest.SerializeToString()
        for _ in range(2):
            async with self._redis.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(latest_key(arm), MARKER_KEY)
                    if self._on_lost is not None and not await pipe.exists(MARKER_KEY):
                        await pipe.reset()
                        await self._on_lost()
                        continue
                    raw = await pipe.get(latest_key(arm))
                    latest = -1 if raw is None else int(raw)
                    if latest != expected:
                        return (
                            latest == version
                            and await pipe.get(manifest_key(arm, version)) == serialized
                        )
                    pipe.multi()
                    pipe.set(manifest_key(arm, version), serialized)
                    if manifest.keyframe:
                        pipe.zadd(keyframes_key(arm), {str(version): version})
                    pipe.set(latest_key(arm), version)
                    pipe.delete(lowest_next_key(arm))
                    pipe.sadd(ARMS_KEY, arm)
                    pipe.publish(published_channel(arm), str(version))
                    await pipe.execute()
                except WatchError:
                    return False
            return True
        raise RegistryLost(f"the registry was lost again while committing {arm} v{version}")

    async def forget(self, arm: str, versions: list[int], blob_uris: list[str]) -> bool:
        """Delete the manifests and keyframe entries of versions, and note their blobs as
        unreferenced, all in one transaction: a reader sees all of them or none gone.
        The caller deletes the blobs afterwards and then calls blobs_deleted. False
        (nothing done) if the registry was lost: what to keep is decided again after
        the rebuild."""
        if not versions:
            return True
        async with self._redis.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(MARKER_KEY)
                if self._on_lost is not None and not await pipe.exists(MARKER_KEY):
                    return False
                pipe.multi()
                pipe.delete(*[manifest_key(arm, v) for v in versions])
                pipe.zrem(keyframes_key(arm), *[str(v) for v in versions])
                if blob_uris:
                    pipe.sadd(unreferenced_blobs_key(arm), *blob_uris)
                await pipe.execute()
            except WatchError:
                return False
        return True

    async def restore(self, arms: Iterable[RestoredArm], marker: str) -> str:
        """Write a rebuilt registry and its marker in one transaction, if the marker is
        still absent and no arm is registered. Returns "restored"; "adopted" when the
        keys are there without a marker (a registry older than the marker: it is
        marked, not rebuilt); "raced" when another server wrote the marker first."""
        async with self._redis.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(MARKER_KEY, ARMS_KEY)
                if await pipe.exists(MARKER_KEY):
                    return "raced"
                registered = await pipe.scard(ARMS_KEY)
                pipe.multi()
                if not registered:
                    for arm in arms:
                        _queue_restore(pipe, arm)
                pipe.set(MARKER_KEY, marker)
                await pipe.execute()
            except WatchError:
                return "raced"
        return "adopted" if registered else "restored"

    async def unreferenced_blobs(self, arm: str) -> list[str]:
        """Blobs whose manifests are gone but which may still be stored."""
        return sorted(
            u.decode() if isinstance(u, bytes) else u
            for u in await self._redis.smembers(unreferenced_blobs_key(arm))
        )

    async def blobs_deleted(self, arm: str, blob_uris: list[str]) -> None:
        if blob_uris:
            await self._redis.srem(unreferenced_blobs_key(arm), *blob_uris)


# Produced by recovery.recover_arm from the blob store; consumed by Registry.restore.
@dataclass(frozen=True)
class RestoredArm:
    """What a rebuild writes for one arm."""

    arm: str
    manifests: tuple[weights_pb2.Manifest, ...]
    """Ascending; the last is the newest complete version, which becomes latest."""
    lowest_next: int
    """The lowest version number the next commit may take: above every version the
    store holds any file of, restored or not."""

    @property
    def latest(self) -> int:
        return self.manifests[-1].version if self.manifests else -1


def _queue_restore(pipe: aioredis.client.Pipeline, restored: RestoredArm) -> None:
    arm = restored.arm
    pipe.sadd(ARMS_KEY, arm)
    for manifest in restored.manifests:
        pipe.set(manifest_key(arm, manifest.version), manifest.SerializeToString())
        if manifest.keyframe:
            pipe.zadd(keyframes_key(arm), {str(manifest.version): manifest.version})
    latest = restored.latest
    if latest >= 0:
        pipe.set(latest_key(arm), latest)
        pipe.publish(published_channel(arm), str(latest))
    if restored.lowest_next > latest + 1:
        pipe.set(lowest_next_key(arm), restored.lowest_next)
