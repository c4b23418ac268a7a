"""The version registry in Redis: latest version per arm, manifests, keyframes.

Keys (per arm): ``rtrl:ws:<arm>:latest`` (int), ``rtrl:ws:<arm>:manifest:<v>``
(serialized Manifest), ``rtrl:ws:<arm>:keyframes`` (sorted set of keyframe
versions), ``rtrl:ws:<arm>:unreferenced_blobs`` (set of URIs of blobs whose
manifests garbage collection deleted, until the blobs are deleted too);
``rtrl:ws:arms`` is the set of arms. Every commit is announced on the pub/sub
channel ``rtrl:ws:<arm>:published`` with the version as the message.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from rtrl.v1 import weights_pb2

PREFIX = "rtrl:ws:"
ARMS_KEY = f"{PREFIX}arms"
PUBLISHED_PATTERN = f"{PREFIX}*:published"


def latest_key(arm: str) -> str:
    return f"{PREFIX}{arm}:latest"


def manifest_key(arm: str, version: int) -> str:
    return f"{PREFIX}{arm}:manifest:{version}"


def keyframes_key(arm: str) -> str:
    return f"{PREFIX}{arm}:keyframes"


def unreferenced_blobs_key(arm: str) -> str:
    return f"{PREFIX}{arm}:unreferenced_blobs"


def published_channel(arm: str) -> str:
    return f"{PREFIX}{arm}:published"


def arm_of_channel(channel: str) -> str:
    return channel.removeprefix(PREFIX).removesuffix(":published")


class Registry:
    def __init__(self, client: aioredis.Redis) -> None:
        self._redis = client

    async def latest(self, arm: str) -> int:
        """The newest committed version of the arm, -1 if none."""
        raw = await self._redis.get(latest_key(arm))
        return -1 if raw is None else int(raw)

    async def latest_by_arm(self) -> dict[str, int]:
        arms = sorted(a.decode() if isinstance(a, bytes) else a for a in await self._redis.smembers(ARMS_KEY))
        values = await self._redis.mget([latest_key(a) for a in arms]) if arms else []
        return {arm: int(v) for arm, v in zip(arms, values) if v is not None}

    async def arms(self) -> list[str]:
        return sorted(a.decode() if isinstance(a, bytes) else a for a in await self._redis.smembers(ARMS_KEY))

    async def latest_and_keyframes(self, arm: str) -> tuple[int, list[int]]:
        """The latest version and every keyframe version (ascending), read together."""
        async with self._redis.pipeline(transaction=True) as pipe:
            raw, keyframes = await pipe.get(latest_key(arm)).zrange(keyframes_key(arm), 0, -1).execute()
        return (-1 if raw is None else int(raw)), sorted(int(k) for k in keyframes)

    async def newest_keyframe(self, arm: str, at_most: int) -> int | None:
        found = await self._redis.zrevrangebyscore(keyframes_key(arm), at_most, "-inf", start=0, num=1)
        return int(found[0]) if found else None

    async def manifest(self, arm: str, version: int) -> weights_pb2.Manifest | None:
        raw = await self._redis.get(manifest_key(arm, version))
        return None if raw is None else weights_pb2.Manifest.FromString(raw)

    async def manifests(self, arm: str, first: int, last: int) -> dict[int, weights_pb2.Manifest]:
        """The manifests of versions first..last that exist."""
        if last < first:
            return {}
        versions = range(first, last + 1)
        raws = await self._redis.mget([manifest_key(arm, v) for v in versions])
        return {v: weights_pb2.Manifest.FromString(raw) for v, raw in zip(versions, raws) if raw is not None}

    async def commit(self, manifest: weights_pb2.Manifest) -> bool:
        """Make manifest.version the latest of its arm, if the latest is still version - 1.

        Atomic (WATCH/MULTI): of two servers racing for one version, one commits and
        the other gets False.
        """
        arm, version = manifest.arm, manifest.version
        async with self._redis.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(latest_key(arm))
                raw = await pipe.get(latest_key(arm))
                if (-1 if raw is None else int(raw)) != version - 1:
                    return False
                pipe.multi()
                pipe.set(manifest_key(arm, version), manifest.SerializeToString())
                if manifest.keyframe:
                    pipe.zadd(keyframes_key(arm), {str(version): version})
                pipe.set(latest_key(arm), version)
                pipe.sadd(ARMS_KEY, arm)
                pipe.publish(published_channel(arm), str(version))
                await pipe.execute()
            except WatchError:
                return False
        return True

    async def forget(self, arm: str, versions: list[int], blob_uris: list[str]) -> None:
        """Delete the manifests and keyframe entries of versions, and note their blobs as
        unreferenced, all in one transaction: a reader sees all of them or none gone.
        The caller deletes the blobs afterwards and then calls blobs_deleted."""
        if not versions:
            return
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(*[manifest_key(arm, v) for v in versions])
            pipe.zrem(keyframes_key(arm), *[str(v) for v in versions])
            if blob_uris:
                pipe.sadd(unreferenced_blobs_key(arm), *blob_uris)
            await pipe.execute()

    async def unreferenced_blobs(self, arm: str) -> list[str]:
        """Blobs whose manifests are gone but which may still be stored."""
        return sorted(u.decode() if isinstance(u, bytes) else u for u in await self._redis.smembers(unreferenced_blobs_key(arm)))

    async def blobs_deleted(self, arm: str, blob_uris: list[str]) -> None:
        if blob_uris:
            await self._redis.srem(unreferenced_blobs_key(arm), *blob_uris)
