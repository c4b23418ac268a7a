"""Garbage collection of old versions: which to delete (plan, pure) and the deletion
(collect, run by the server every gc_interval_s).

A delta chain never crosses a keyframe (lineage.sync_path), so a subscriber only
ever needs the newest keyframe and the deltas after it, or deltas after what it
holds. Collection keeps the newest keep_keyframes keyframes and every version after
the oldest of them, and deletes everything older. It follows that the latest version
and its one path are always kept, and that a keyframe is collected only once a newer
keyframe exists: an arm that stays at one version (the A/B control arm, pinned at
its warm start v0) keeps it for good.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from rtrl.weight_sync.registry import Registry
from rtrl.weight_sync.store import BlobStore

log = logging.getLogger("weight_sync")
_MANIFESTS_PER_READ = 256


# Produced by collect() from the registry; consumed by plan().
@dataclass(frozen=True)
class ArmView:
    arm: str
    latest: int
    """The arm's latest version, -1 if none."""
    keyframes: tuple[int, ...]
    """Every version in the arm's keyframe set."""
    blob_uris: Mapping[int, str]
    """Blob URI by version, of the stored manifests that collection may delete (collect
    reads those below the newest keyframe; newer ones are always kept)."""


# Produced by plan(); consumed by collect() and the tests.
@dataclass(frozen=True)
class ArmPlan:
    arm: str
    keep_from: int | None
    """The oldest version kept; None while the arm has no keyframe at or below latest."""
    versions: tuple[int, ...] = ()
    """Versions whose manifests (and keyframe entries) are deleted."""
    blob_uris: tuple[str, ...] = ()
    """Their blobs, deleted once the manifests are gone."""


def plan(view: ArmView, keep_keyframes: int) -> ArmPlan:
    """What collection deletes from one arm (everything below the keep_keyframes-th
    newest keyframe at or below latest)."""
    if keep_keyframes < 1:
        raise ValueError(f"keep_keyframes must be at least 1, not {keep_keyframes}")
    # A keyframe above the latest version is from a newer view than latest; ignoring it only keeps more.
    keyframes = sorted(k for k in view.keyframes if 0 <= k <= view.latest)
    if not keyframes:
        return ArmPlan(view.arm, None)
    keep_from = keyframes[-keep_keyframes:][0]
    versions = sorted(
        {v for v in view.blob_uris if v < keep_from} | {k for k in view.keyframes if k < keep_from}
    )
    return ArmPlan(
        view.arm,
        keep_from,
        versions=tuple(versions),
        blob_uris=tuple(view.blob_uris[v] for v in versions if v in view.blob_uris),
    )


async def view_of(registry: Registry, arm: str) -> ArmView:
    latest, keyframes = await registry.latest_and_keyframes(arm)
    blob_uris: dict[int, str] = {}
    if keyframes:
        # Manifests below the oldest keyframe entry were deleted by an earlier collection,
        # in the same transaction as that entry (the first version of an arm is a keyframe).
        first, end = keyframes[0], min(keyframes[-1], latest + 1)
        # In slices: the first collection of a long history must not hold every manifest at once.
        for start in range(first, end, _MANIFESTS_PER_READ):
            manifests = await registry.manifests(
                arm, start, min(start + _MANIFESTS_PER_READ, end) - 1
            )
            blob_uris.update((v, m.blob_uri) for v, m in manifests.items())
    return ArmView(arm, latest, tuple(keyframes), blob_uris)


async def collect(registry: Registry, store: BlobStore, keep_keyframes: int) -> list[ArmPlan]:
    """Collect every arm: delete the planned manifests first, then their blobs, so no
    manifest ever names a blob that was deleted on purpose. The blobs are noted in the
    registry with the manifests' deletion, so a collection cut short between the two
    steps is finished by the next one. Returns the plans carried out."""
    plans = []
    for arm in await registry.arms():
        arm_plan = plan(await view_of(registry, arm), keep_keyframes)
        if not await registry.forget(arm, list(arm_plan.versions), list(arm_plan.blob_uris)):
            log.warning(
                "registry lost during garbage collection of %s; collecting again after the rebuild",
                arm,
            )
            continue
        unreferenced = await registry.unreferenced_blobs(arm)
        for blob_uri in unreferenced:
            if store.owns(blob_uri):
                await asyncio.to_thread(store.delete, blob_uri)
            else:
                log.warning(
                    "not deleting %s: it is not in the store at %s (blob_url changed?)",
                    blob_uri,
                    store.url,
                )
        await registry.blobs_deleted(arm, unreferenced)
        if arm_plan.versions:
            log.info(
                "collected %s v%d..v%d (%d versions); keeping v%d on",
                arm,
                arm_plan.versions[0],
                arm_plan.versions[-1],
                len(arm_plan.versions),
                arm_plan.keep_from,
            )
        plans.append(arm_plan)
    return plans
