"""The refusal policy (weight_sync/refusals.py): each version is refused and counted once,
by number and manifest; the pause before a fresh start doubles per strike up to its cap,
loses at most ``jitter`` of itself, and resets when a version is taken."""

from __future__ import annotations

import functools

import pytest

from rtrl.v1 import weights_pb2
from rtrl.weight_sync.refusals import (
    FORGED,
    ROLLED_BACK,
    UNDECODABLE,
    RefusalBackoff,
    Refusals,
)

EXACT = RefusalBackoff(min_s=1.0, max_s=60.0, jitter=0)


def _manifest(version: int, checksum: str = "aa", arm: str = "treatment") -> weights_pb2.Manifest:
    return weights_pb2.Manifest(arm=arm, version=version, keyframe=True, blob_checksum=checksum)


def test_a_version_is_refused_and_counted_once_however_often_it_comes():
    refusals = Refusals(EXACT)
    v3 = _manifest(3)
    assert not refusals.known(v3)
    refusals.refuse(v3, FORGED)
    for _ in range(5):
        assert refusals.known(_manifest(3))  # the same manifest, fetched again
    assert (refusals.total, refusals.counts[FORGED]) == (1, 1)


@pytest.mark.parametrize(
    "other",
    [_manifest(3, checksum="bb"), _manifest(4), _manifest(3, arm="control")],
    ids=["same number, another manifest", "another number", "another arm"],
)
def test_another_manifest_is_another_version_judged_afresh(other):
    refusals = Refusals(EXACT)
    refusals.refuse(_manifest(3), ROLLED_BACK)
    assert not refusals.known(other)


def test_the_pause_doubles_with_each_strike_up_to_its_cap_and_a_taken_version_resets_it():
    refusals = Refusals(EXACT)
    assert refusals.pause_s() == 0  # nothing refused: no pause
    pauses = []
    for version in range(9):
        refusals.refuse(_manifest(version), FORGED)
        pauses.append(refusals.pause_s())
    assert pauses == [1, 2, 4, 8, 16, 32, 60, 60, 60]
    assert refusals.known(_manifest(0)) and refusals.pause_s() == 60  # a repeat is a strike
    refusals.taken()
    assert refusals.pause_s() == 0
    refusals.refuse(_manifest(20), FORGED)
    assert refusals.pause_s() == 1
    assert refusals.total == 10  # repeats are strikes, not refusals


def test_jitter_takes_off_at_most_its_fraction():
    backoff = RefusalBackoff(min_s=1.0, max_s=60.0, jitter=0.25)
    for draw, pause in [(0.0, 4.0), (0.5, 3.5), (0.999, 3.001)]:
        refusals = Refusals(backoff, rng=functools.partial(float, draw))
        for version in range(3):
            refusals.refuse(_manifest(version), FORGED)
        assert refusals.pause_s() == pytest.approx(pause)


def test_a_failed_decode_starts_over_once_then_the_version_is_refused():
    refusals = Refusals(EXACT)
    v5 = _manifest(5)
    assert refusals.failed_to_decode(v5)  # the worker's own copy may be at fault: start over
    assert refusals.total == 0 and refusals.pause_s() == 1
    assert not refusals.failed_to_decode(_manifest(5))  # again, from a keyframe: refused
    assert refusals.known(v5)
    assert (refusals.total, refusals.counts[UNDECODABLE]) == (1, 1)


def test_only_the_newest_refusals_are_remembered():
    refusals = Refusals(RefusalBackoff(jitter=0, remember=2))
    for version in range(3):
        refusals.refuse(_manifest(version), FORGED)
    assert [refusals.known(_manifest(v)) for v in (1, 2, 0)] == [True, True, False]


@pytest.mark.parametrize(
    "settings",
    [
        {"min_s": 0},
        {"min_s": 2, "max_s": 1},
        {"jitter": 1},
        {"jitter": -0.1},
        {"remember": 0},
    ],
)
def test_bad_backoff_settings_fail_at_start(settings):
    with pytest.raises(ValueError):
        RefusalBackoff(**settings)
