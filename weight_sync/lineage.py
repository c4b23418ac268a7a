"""Which versions a subscriber needs, and which publishes the registry accepts.

Pure functions over manifests, shared by the server and the clients; no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping

from rtrl.v1 import weights_pb2


def keyframe_due(version: int, keyframe_every: int) -> bool:
    """Publishers send a full snapshot at every multiple of keyframe_every (version 0 included)."""
    return version % keyframe_every == 0


def _deltas_available(first: int, last: int, available: Mapping[int, weights_pb2.Manifest]) -> bool:
    for version in range(first, last + 1):
        manifest = available.get(version)
        if manifest is None or manifest.keyframe or manifest.parent_version != version - 1:
            return False
    return True


def sync_path(
    have_version: int,
    latest: int,
    newest_keyframe: int | None,
    available: Mapping[int, weights_pb2.Manifest],
) -> list[int] | None:
    """The versions to send, in order, to bring a subscriber from have_version to latest.

    ``available`` holds the versions whose manifest and blob are intact. Deltas from
    have_version when all of them are there; otherwise the newest keyframe and the
    deltas after it. (An older keyframe never helps: its chain would have to pass
    through the newer keyframe, which is no delta.) None when neither exists; [] when
    there is nothing to send. A have_version above latest means the subscriber's
    lineage is unknown here, so it gets the keyframe path.
    """
    if latest < 0 or have_version == latest:
        return []
    if 0 <= have_version < latest and _deltas_available(have_version + 1, latest, available):
        return list(range(have_version + 1, latest + 1))
    if (
        newest_keyframe is not None
        and newest_keyframe in available
        and _deltas_available(newest_keyframe + 1, latest, available)
    ):
        return list(range(newest_keyframe, latest + 1))
    return None


def publish_problem(
    manifest: weights_pb2.Manifest,
    latest: int,
    newest_keyframe: int | None,
    keyframe_every: int,
    next_version: int | None = None,
) -> str | None:
    """Why a publish (whose manifest.parent_version is the latest version the publisher
    saw) cannot become version next_version (latest + 1 unless a rebuilt registry
    skips numbers it could not restore), or None if it can. Every reason here is a
    FAILED_PRECONDITION: the publisher recovers by resending a keyframe on top of latest."""
    if manifest.parent_version != latest:
        return f"parent_version {manifest.parent_version} is not the latest version {latest} of arm {manifest.arm!r}"
    if manifest.keyframe:
        return None
    if next_version is not None and next_version != latest + 1:
        return (
            f"version {next_version} of arm {manifest.arm!r} must be a keyframe: "
            f"versions {latest + 1}..{next_version - 1} were lost with the registry, "
            "and a delta chain has no gaps"
        )
    if latest < 0:
        return f"the first version of arm {manifest.arm!r} must be a keyframe"
    chain_start = -1 if newest_keyframe is None else newest_keyframe
    if latest + 1 - chain_start >= keyframe_every:
        return (
            f"version {latest + 1} of arm {manifest.arm!r} must be a keyframe: the newest keyframe is "
            f"{newest_keyframe} and the server keeps delta chains shorter than keyframe_every={keyframe_every}"
        )
    return None
