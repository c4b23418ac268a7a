"""Rebuilding a lost registry from the blob store.

Every committed version's manifest lies in the store beside its blob, written after
the blob and before the Redis commit (servicer.py), each file whole or absent. So
the store holds every committed version, plus at most the last one a server wrote
but did not commit. When the registry's marker is gone (registry.py), each arm is
rebuilt from the store: its latest version becomes the newest one whose chain —
the keyframe and every delta after it — has manifests that check out and blobs
that match their checksums; versions below that chain's keyframe come back when
their manifest checks out and their blob is listed (a subscriber's path verifies
blobs anyway). Version numbers the store holds any file of are never given out
again, restored or not: a worker may hold a version whose blob rotted since.

recover_arm is pure over what the store lists and reads; RegistryRecovery runs it
for the server, once for any number of racing callers and servers.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from rtrl.heartbeat import RegistryRebuild
from rtrl.v1 import weights_pb2
from rtrl.weight_sync.checksum import xxh3_hex
from rtrl.weight_sync.registry import Registry, RestoredArm
from rtrl.weight_sync.store import ArmFiles, BlobSizeMismatch, BlobStore

log = logging.getLogger("weight_sync")


def stored_manifest(manifest: weights_pb2.Manifest) -> bytes:
    """The manifest as written to the store: its checksum, a newline, its bytes. A
    protobuf cut short at a field boundary still parses; with the checksum it does not pass."""
    body = manifest.SerializeToString()
    return xxh3_hex(body).encode() + b"\n" + body


def parse_stored_manifest(data: bytes) -> weights_pb2.Manifest:
    """The manifest stored_manifest wrote; ValueError if the file is not whole."""
    checksum, newline, body = data.partition(b"\n")
    if not newline or checksum.decode(errors="replace") != xxh3_hex(body):
        raise ValueError("checksum of the manifest file does not match (torn or altered)")
    try:
        return weights_pb2.Manifest.FromString(body)
    except DecodeError as exc:
        raise ValueError(f"manifest does not parse: {exc}") from exc


# Produced by recover_arm; consumed by RegistryRecovery (restore and logs) and the tests.
@dataclass(frozen=True)
class RecoveredArm:
    restored: RestoredArm
    unusable: dict[int, str]
    """Why each version that was looked at and left out was left out."""


def recover_arm(
    arm: str,
    files: ArmFiles,
    read_manifest: Callable[[int], bytes],
    read_blob: Callable[[weights_pb2.Manifest], bytes],
) -> RecoveredArm:
    """What to restore of one arm, from the versions the store lists and a way to read
    their manifests and blobs (FileNotFoundError for a file gone since the listing)."""
    manifests, unusable = _read_manifests(arm, files, read_manifest)
    for version in sorted(files.blobs - files.manifests):
        unusable[version] = "blob without a manifest (written, never committed)"
    newest = _Chains(manifests, read_blob, unusable).newest()
    older = [v for v in sorted(manifests) if newest and v < newest[0] and v in files.blobs]
    kept = older + newest
    for version in sorted(set(manifests) - set(kept)):
        if version not in files.blobs:
            unusable.setdefault(version, "blob missing")
        else:
            unusable.setdefault(
                version,
                f"not on a complete chain (newest complete: v{newest[-1]})"
                if newest
                else "no complete chain",
            )
    lowest_next = max(files.manifests | files.blobs, default=-1) + 1
    restored = RestoredArm(arm, tuple(manifests[v] for v in kept), lowest_next)
    return RecoveredArm(restored, {v: unusable[v] for v in sorted(unusable) if v not in kept})


def _read_manifests(
    arm: str, files: ArmFiles, read_manifest: Callable[[int], bytes]
) -> tuple[dict[int, weights_pb2.Manifest], dict[int, str]]:
    """The listed manifests that are whole and consistent, and why each other one is not."""
    manifests: dict[int, weights_pb2.Manifest] = {}
    unusable: dict[int, str] = {}
    for version in sorted(files.manifests):
        try:
            manifest = parse_stored_manifest(read_manifest(version))
        except (FileNotFoundError, ValueError) as exc:
            unusable[version] = f"manifest unusable: {exc}"
            continue
        problem = _manifest_problem(arm, version, manifest)
        if problem:
            unusable[version] = problem
        else:
            manifests[version] = manifest
    return manifests, unusable


class _Chains:
    """Walks from a version down to its keyframe over usable manifests, reading each blob
    at most once and noting in ``unusable`` why a version broke its chain."""

    def __init__(
        self,
        manifests: dict[int, weights_pb2.Manifest],
        read_blob: Callable[[weights_pb2.Manifest], bytes],
        unusable: dict[int, str],
    ) -> None:
        self._manifests = manifests
        self._read_blob = read_blob
        self._unusable = unusable
        self._checked: dict[int, str | None] = {}
        """Version -> what is wrong with its blob (None: nothing), once read."""

    def newest(self) -> list[int]:
        """The newest complete chain, keyframe first; empty when there is none."""
        for version in sorted(self._manifests, reverse=True):
            found = self.chain(version)
            if found is not None:
                return found
        return []

    def chain(self, version: int) -> list[int] | None:
        """version's keyframe and the deltas up to it, if every one is intact."""
        versions = []
        while True:
            if version not in self._manifests:
                self._unusable.setdefault(version, "missing")
                return None
            if version not in self._checked:
                problem = _blob_problem(self._manifests[version], self._read_blob)
                self._checked[version] = problem
                if problem:
                    self._unusable[version] = problem
            if self._checked[version]:
                return None
            versions.append(version)
            if self._manifests[version].keyframe:
                return versions[::-1]
            version -= 1


def _blob_problem(
    manifest: weights_pb2.Manifest, read_blob: Callable[[weights_pb2.Manifest], bytes]
) -> str | None:
    try:
        blob = read_blob(manifest)
    except FileNotFoundError:
        return "blob missing"
    except BlobSizeMismatch as exc:
        return f"blob does not match the manifest, refused unread: {exc}"
    except ValueError as exc:
        return f"blob URI unusable: {exc}"
    if len(blob) != manifest.blob_size or xxh3_hex(blob) != manifest.blob_checksum:
        return f"blob does not match the manifest ({len(blob)} bytes, checksum {xxh3_hex(blob)})"
    return None


def _manifest_problem(arm: str, version: int, manifest: weights_pb2.Manifest) -> str | None:
    if manifest.arm != arm or manifest.version != version:
        return f"manifest is of {manifest.arm} v{manifest.version}, stored as {arm} v{version}"
    if manifest.keyframe and manifest.parent_version != -1:
        return f"keyframe with parent_version {manifest.parent_version}"
    if not manifest.keyframe and manifest.parent_version != version - 1:
        return f"delta on v{manifest.parent_version}, not on v{version - 1}"
    if not manifest.blob_uri or not manifest.blob_checksum:
        return "manifest names no blob"
    return None


def recover_store(store: BlobStore) -> list[RecoveredArm]:
    """recover_arm for every arm the store holds files of (blocking: reads the store)."""
    return [
        recover_arm(
            arm,
            files,
            functools.partial(store.read_manifest, arm),
            lambda manifest: store.read(manifest.blob_uri, manifest.blob_size),
        )
        for arm, files in store.listing().items()
    ]


class RegistryRecovery:
    """Keeps the server's registry present: ensure() rebuilds it from the store when
    its marker is gone. Callers racing in one server wait for one rebuild; between
    servers the registry's transaction lets the first one through (Registry.restore)."""

    def __init__(self, registry: Registry, store: BlobStore) -> None:
        """registry: a plain Registry (no on_lost) over the server's Redis."""
        self._registry = registry
        self._store = store
        self._lock = asyncio.Lock()
        self.rebuilds = 0
        """Lost registries this server rebuilt with at least one arm."""
        self.last_rebuild: RegistryRebuild | None = None
        """When, and to which latest version per arm, for the heartbeat."""

    async def ensure(self) -> None:
        async with self._lock:
            if await self._registry.marked():
                return
            log.warning(
                "the weight registry's marker is missing: rebuilding the registry from the blob store at %s",
                self._store.url,
            )
            recovered = await asyncio.to_thread(recover_store, self._store)
            marker = f"{int(time.time() * 1000)} {self._store.url}"
            outcome = await self._registry.restore([arm.restored for arm in recovered], marker)
            for arm in recovered:
                if arm.unusable:
                    log.warning(
                        "registry rebuild: %s left out %s",
                        arm.restored.arm,
                        "; ".join(f"v{v}: {why}" for v, why in arm.unusable.items()),
                    )
            if outcome == "restored" and recovered:
                self.rebuilds += 1
                latest = {arm.restored.arm: arm.restored.latest for arm in recovered}
                self.last_rebuild = RegistryRebuild(ts_ms=int(time.time() * 1000), latest=latest)
                log.warning(
                    "registry rebuilt from %s: %s",
                    self._store.url,
                    ", ".join(
                        f"{a.restored.arm} latest v{a.restored.latest} "
                        f"({len(a.restored.manifests)} manifests, "
                        f"next version {max(a.restored.lowest_next, a.restored.latest + 1)})"
                        for a in recovered
                    ),
                )
            elif outcome == "restored":
                log.info("new weight registry (the blob store at %s is empty)", self._store.url)
            elif outcome == "adopted":
                log.info("weight registry predates its marker: marked, not rebuilt")
            else:
                log.info("another weight_sync server rebuilt the registry first")
