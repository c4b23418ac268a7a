"""Heartbeats as the tests read them: typed by rtrl.heartbeat's parser, as `rtrl status`
and the health checks read them, never as JSON dicts, so a renamed field fails the type
check instead of a key lookup at run time; and waited for through support.wait."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import redis

from rtrl import heartbeat
from support import wait

B = TypeVar("B", bound=heartbeat.Beat)

SERVICE_OF: dict[type, str] = {kind: service for service, kind in heartbeat.BEATS.items()}


def beats_of(client: redis.Redis, kind: type[B]) -> list[B]:
    """Every live beat of one service (one per instance), in key order."""
    return [hb.beat for hb in heartbeat.read(client) if isinstance(hb.beat, kind)]


def beat_of(
    client: redis.Redis, kind: type[B], instance: str = "0", after: float = 0.0
) -> B | None:
    """One instance's live beat, if it was written after ``after`` (wall clock, seconds:
    ``time.time()`` taken once the traffic a beat must count is over)."""
    hb = heartbeat.read_one(client, SERVICE_OF[kind], instance)
    if hb is None or hb.ts <= after:
        return None
    assert isinstance(hb.beat, kind), hb
    return hb.beat


def wait_for_beat(
    client: redis.Redis,
    kind: type[B],
    what: str,
    *,
    ready: Callable[[B], object] = bool,
    instance: str = "0",
    after: float = 0.0,
    timeout_s: float = 90.0,
    watching: Iterable[wait.Watched] = (),
) -> B:
    """The first beat of ``kind`` from ``instance`` (written after ``after``) that ``ready``
    accepts (by default, any); ``what`` says what it must show. Beats come about once a
    second. ``watching``: as for support.wait.until."""
    beat = wait.until(
        lambda: beat_of(client, kind, instance, after),
        f"a {SERVICE_OF[kind]}:{instance} beat showing {what}",
        ready=lambda seen: seen is not None and ready(seen),
        timeout_s=timeout_s,
        interval_s=0.2,
        watching=watching,
    )
    assert beat is not None
    return beat


def wait_for_settled(redis_url: str, *, settled: int, refused: int) -> heartbeat.RewardStreamBeat:
    """The joiner's first beat with ``settled`` rollouts settled, ``refused`` records refused
    as unauthenticated and nothing pending: what the forgery tests wait for."""
    client = redis.Redis.from_url(redis_url)
    try:
        return wait_for_beat(
            client,
            heartbeat.RewardStreamBeat,
            f"{settled} honest rollouts settled and {refused} forgeries refused",
            ready=lambda beat: (
                beat.settled >= settled and beat.unauthenticated >= refused and beat.pending == 0
            ),
        )
    finally:
        client.close()
