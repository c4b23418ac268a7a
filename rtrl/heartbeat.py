"""Service heartbeats in Redis: how the supervisor, health checks and `rtrl status` see
each process.

Each process writes ``rtrl:hb:<service>:<instance>`` with a short TTL: a JSON document
holding the envelope (service, instance, ts) and, beside it, the fields of that
service's beat below. A missing key means the process is down or wedged.

Every beat is a frozen dataclass that says who produces and who reads it. Readers go
through ``parse``: a field a newer writer added is ignored and one an older writer
lacks takes its default, so a reader and a writer one release apart still agree.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
import types
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Union, get_args, get_origin, get_type_hints

import redis
import redis.asyncio as aioredis

KEY_PREFIX = "rtrl:hb:"
TTL_S = 10
MAX_BEAT_BYTES = 1 << 20
"""The most a reader takes of one heartbeat (1 MiB; the largest the stack writes, a joiner's
with its alerts, is a few KiB). A larger one is reported invalid, never read whole: a junk
beat of 8 MB written by whoever holds a service's Redis password made `rtrl status` fail."""


# Produced by ingest.gateway.Gateway.status; consumed by `rtrl status` and benches.
@dataclass(frozen=True)
class IngestBeat:
    accepted: int = 0
    duplicate: int = 0
    rejected: int = 0
    retry: int = 0
    privacy: int = 0
    """Privacy-mode events counted (never published)."""
    inflight: int = 0
    """Requests being answered now."""


# Produced by reward_stream.monitors.reward_by_version; consumed by the reward trend of
# `rtrl status`, which adds up the workers' counts per version.
@dataclass(frozen=True)
class RewardByVersion:
    version: int
    rollouts: int
    reward_mean: float


# Produced by reward_stream.monitors (step and drift checks); consumed by the joiner's
# log, `rtrl status`, the demo's footer and whoever holds a publish on it.
@dataclass(frozen=True)
class RewardAlert:
    """A shift in one behaviour between two policy versions (step) or two windows of
    versions (drift)."""

    metric: str
    previous_version: int
    """The previous version; for drift, the newest version of the reference window."""
    version: int
    """This version; for drift, the newest version of the window that drifted."""
    previous_value: float
    """The previous version's (or reference window's) rate (or mean)."""
    value: float
    """This version's (or window's) rate (or mean)."""
    z_score: float
    examples: tuple[str, ...]
    """Up to max_examples rollout ids of this version (window) showing the shift."""
    kind: str = "step"
    """"step" (consecutive versions) or "drift" (pooled windows of versions)."""
    previous_first_version: int = -1
    """Oldest version of the reference window (drift); previous_version for a step."""
    first_version: int = -1
    """Oldest version of the window that drifted; version for a step."""
    previous_samples: int = 0
    samples: int = 0


# Produced by reward_stream.app (the Joiner's counters and its consumer); consumed by
# `rtrl status` (alerts, reward trend), health (assigned) and `rtrl bench join`.
@dataclass(frozen=True)
class RewardStreamBeat:
    events: int = 0
    duplicates: int = 0
    settled: int = 0
    defaulted: int = 0
    late: int = 0
    dlq: int = 0
    dropped: int = 0
    privacy_dropped: int = 0
    unauthenticated: int = 0
    """Records refused because their writer did not sign them (also counted in dlq): rollouts
    no inference worker signed, events the ingest gateway did not authenticate."""
    foreign: int = 0
    """Events left out of a reward because another client's key sent them."""
    orphans_dropped: int = 0
    """Rollouts dropped when their window closed without a record, the gateway having
    said no worker served them."""
    evicted: int = 0
    """Rollouts without a record evicted past their client's or the total orphan bytes."""
    first_event_ms: int = 0
    """Wall clock when the first record was read (0: none yet)."""
    last_event_ms: int = 0
    """Wall clock when the latest record was read: a worker whose input has records but
    whose last_event_ms stands still is stuck; benchmarks time reads with the pair."""
    pending: int = 0
    """Rollouts waiting for their window to close."""
    partitions: tuple[int, ...] = ()
    """Partitions whose join state this worker holds."""
    alerts: tuple[RewardAlert, ...] = ()
    """The newest reward-hacking alerts, oldest first."""
    reward_by_version: tuple[RewardByVersion, ...] = ()
    assigned: int = 0
    """Partitions the consumer group gave this worker (0: the group has not formed)."""
    in_flight: int = 0
    """Outputs not yet acked by the broker."""
    unacked: int = 0
    """Inputs whose offsets wait for their outputs' acks."""


# Produced by trainer.evaluation.Verdict.summary; consumed by the trainer's beat, its
# journal and `rtrl status`.
@dataclass(frozen=True)
class GateVerdict:
    accepted: bool
    candidate: Mapping[str, float]
    """The candidate's score per checker."""
    published: Mapping[str, float]
    control: Mapping[str, float]
    regressions: tuple[str, ...] = ()
    """``"checker vs reference: candidate < reference - tolerance"``, one per failed check."""


# Produced by trainer.report.Reporter when the eval gate refuses a candidate; consumed by
# `rtrl status` (its refusals table) and tests.
@dataclass(frozen=True)
class GateRefusal:
    step: int
    ts_ms: int
    rollouts: int
    """Rollouts the refused candidate was trained on."""
    accepted: bool
    candidate: Mapping[str, float]
    published: Mapping[str, float]
    control: Mapping[str, float]
    regressions: tuple[str, ...] = ()


# Produced by trainer.report.Reporter from a step's trainer.mismatch.Mismatch; consumed by the
# trainer's beat and `rtrl status` (its row, and --json).
@dataclass(frozen=True)
class TrainerMismatch:
    """|log π_trainer − log π_sampler| (nats) on the tokens sampled by the weights a step
    started from (trainer/mismatch.py)."""

    step: int
    """The step that measured it: steps since measured nothing (they started from weights
    no worker had sampled with)."""
    mean: float
    max: float
    over_threshold_share: float
    """Share of the measured tokens over ``threshold``."""
    threshold: float
    tokens: int


# Produced by trainer.report.Reporter (Trainer.heartbeat); consumed by `rtrl status`,
# health (published version) and `rtrl bench loop`.
@dataclass(frozen=True)
class TrainerBeat:
    step: int = 0
    version: int = -1
    """Treatment's newest published version (-1: none yet)."""
    rollouts_trained: int = 0
    pending: int = 0
    reward_mean: float | None = None
    """Mean batch reward over the last reward_window_steps steps."""
    kl: float | None = None
    entropy: float | None = None
    grad_norm: float | None = None
    dropped_stale: int = 0
    dropped: Mapping[str, int] = field(default_factory=dict)
    """Rollouts dropped by reason (stale, shed, duplicate...)."""
    batch_wait_s: float | None = None
    """From the first rollout of the batch arriving to the step starting."""
    step_s: float | None = None
    publish_s: float | None = None
    event_to_publish_s: float | None = None
    """Wall clock at publish minus the newest event time trained on."""
    eval_s: float | None = None
    gate: GateVerdict | None = None
    """The last verdict of the eval gate."""
    refused: int = 0
    """Candidates the eval gate refused since this process started."""
    refusals: tuple[GateRefusal, ...] = ()
    """The most recent refusals."""
    mismatch: TrainerMismatch | None = None
    """The train–inference mismatch of the last step that measured any token; None: none has yet."""


# Produced by inference.server.InferenceServer.status; consumed by health (ready, both
# arms served), `rtrl status` (versions per worker and arm), benches and tests.
@dataclass(frozen=True)
class InferenceBeat:
    ready: bool = False
    versions: Mapping[str, int] = field(default_factory=dict)
    """The version each arm serves (-1: none yet)."""
    weights_digests: Mapping[str, str] = field(default_factory=dict)
    http_port: int = 0
    worker_id: str = ""
    completions: int = 0
    tokens: int = 0
    swaps: int = 0
    batches: int = 0
    queue_depth: int = 0
    rollout_records: int = 0
    private_completions: int = 0
    rejected: int = 0
    unavailable: int = 0
    unrecorded: int = 0
    weights_refused: int = 0
    """Versions whose manifest signature did not verify (never applied)."""


# Produced by weight_sync.recovery when it rebuilds a lost registry; consumed by the
# weight_sync beat.
@dataclass(frozen=True)
class RegistryRebuild:
    ts_ms: int
    latest: Mapping[str, int]
    """The latest version per arm the rebuilt registry holds."""


# Produced by weight_sync.server.WeightSyncServer.status; consumed by `rtrl status`,
# `rtrl bench broadcast` and tests.
@dataclass(frozen=True)
class WeightSyncBeat:
    port: int = 0
    latest: Mapping[str, int] = field(default_factory=dict)
    subscribers: int = 0
    bytes_sent: int = 0
    versions_published: int = 0
    versions_collected: int = 0
    registry_rebuilds: int = 0
    last_registry_rebuild: RegistryRebuild | None = None


# Produced by analytics.sink.Sink.status; consumed by `rtrl status` and tests.
@dataclass(frozen=True)
class AnalyticsBeat:
    consumed: int = 0
    pending: int = 0
    """Rows buffered, not yet inserted."""
    inserted: Mapping[str, int] = field(default_factory=dict)
    """Rows inserted per table."""


Beat = IngestBeat | RewardStreamBeat | TrainerBeat | InferenceBeat | WeightSyncBeat | AnalyticsBeat

BEATS: dict[str, type[Beat]] = {
    "ingest": IngestBeat,
    "reward_stream": RewardStreamBeat,
    "trainer": TrainerBeat,
    "inference": InferenceBeat,
    "weight_sync": WeightSyncBeat,
    "analytics": AnalyticsBeat,
}


@dataclass(frozen=True)
class Heartbeat:
    """One process's latest heartbeat, as read back from Redis."""

    service: str
    instance: str
    ts: float
    """Wall clock of the beat (seconds)."""
    beat: Beat

    @property
    def name(self) -> str:
        return f"{self.service}:{self.instance}"


class HeartbeatError(ValueError):
    """A heartbeat document that is not JSON, names no known service, or is too large."""


@dataclass(frozen=True)
class InvalidBeat:
    """Produced by read_checked; consumed by ops.health, which shows the service unhealthy."""

    name: str
    """``service:instance`` as its key names them."""
    reason: str


def key(service: str, instance: str) -> str:
    return f"{KEY_PREFIX}{service}:{instance}"


def document(service: str, instance: str, beat: Beat, ts: float | None = None) -> dict[str, Any]:
    """The JSON document stored for a beat: the envelope and the beat's fields side by side."""
    if not isinstance(beat, BEATS[service]):
        raise TypeError(f"{service} beats are {BEATS[service].__name__}, not {type(beat).__name__}")
    return {
        "service": service,
        "instance": instance,
        "ts": time.time() if ts is None else ts,
        **dataclasses.asdict(beat),
    }


def parse(doc: Mapping[str, Any] | bytes | str) -> Heartbeat:
    """A stored document (or its JSON) as a typed Heartbeat."""
    if isinstance(doc, (bytes, str)):
        try:
            doc = json.loads(doc)
        except ValueError as error:
            raise HeartbeatError(f"a heartbeat that is not JSON: {error}") from error
    if not isinstance(doc, Mapping):
        raise HeartbeatError(f"a heartbeat is a JSON object, not {type(doc).__name__}")
    service = doc.get("service")
    if service not in BEATS:
        raise HeartbeatError(f"a heartbeat of unknown service {service!r}")
    return Heartbeat(
        service,
        str(doc.get("instance", "")),
        float(doc.get("ts", 0.0)),
        _build(BEATS[service], doc),
    )


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """A beat class's field names and their (resolved) types: read once per class, not per
    beat, since `rtrl status -w` and the health checks parse every beat every second."""
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _build(cls: type, doc: Mapping[str, Any]) -> Any:
    types_ = _field_types(cls)
    return cls(
        **{name: _decode(types_[name], value) for name, value in doc.items() if name in types_}
    )


def _decode(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return _decode(next(arg for arg in get_args(hint) if arg is not type(None)), value)
    if origin is tuple:
        return tuple(_decode(get_args(hint)[0], item) for item in value)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _build(hint, value)
    return value


async def beat(client: aioredis.Redis, service: str, instance: str, status: Beat) -> None:
    await client.set(
        key(service, instance), json.dumps(document(service, instance, status)), ex=TTL_S
    )


async def beat_forever(
    client: aioredis.Redis,
    service: str,
    instance: str,
    status: Callable[[], Beat] | Callable[[], Awaitable[Beat]],
    interval_s: float = 1.0,
) -> None:
    while True:
        current = status()
        await beat(
            client, service, instance, await current if isinstance(current, Awaitable) else current
        )
        await asyncio.sleep(interval_s)


def _checked(stored: str, raw: bytes | str, max_bytes: int) -> Heartbeat:
    """The beat stored under the key ``stored``, read no further than ``max_bytes``: its document must be
    the beat of the service and instance its key names (Redis lets each service's user write
    only its own keys, ops/redis_acl.py, so the key says who wrote it and the document cannot)."""
    if len(raw.encode() if isinstance(raw, str) else raw) > max_bytes:
        raise HeartbeatError(f"a heartbeat over {max_bytes} bytes")
    beat = parse(raw)
    if stored != key(beat.service, beat.instance):
        raise HeartbeatError(f"a {beat.service} beat for {beat.name} stored under {stored}")
    return beat


def read_checked(
    client: redis.Redis, max_bytes: int = MAX_BEAT_BYTES
) -> tuple[list[Heartbeat], list[InvalidBeat]]:
    """Every live heartbeat, typed, and every one no reader can take (too large, not JSON, of
    an unknown service, or not the beat its key names), each read only to ``max_bytes`` + 1."""
    beats, invalid = [], []
    for raw_key in sorted(client.scan_iter(f"{KEY_PREFIX}*")):
        name = raw_key.decode() if isinstance(raw_key, bytes) else str(raw_key)
        raw = client.getrange(name, 0, max_bytes)
        if not raw:
            continue  # expired between the scan and the read
        try:
            beats.append(_checked(name, raw, max_bytes))
        except HeartbeatError as error:
            invalid.append(InvalidBeat(name.removeprefix(KEY_PREFIX), str(error)))
    return beats, invalid


def read_all(client: redis.Redis) -> list[dict[str, Any]]:
    """Every live heartbeat document a reader takes, from a synchronous redis client."""
    beats, _ = read_checked(client)
    return [document(hb.service, hb.instance, hb.beat, hb.ts) for hb in beats]


def read(client: redis.Redis) -> list[Heartbeat]:
    """Every live heartbeat, typed (a document no reader takes is left out: read_checked)."""
    return read_checked(client)[0]


def read_one(client: redis.Redis, service: str, instance: str) -> Heartbeat | None:
    """One instance's beat, or None; HeartbeatError if it is one no reader takes."""
    stored = key(service, instance)
    raw = client.getrange(stored, 0, MAX_BEAT_BYTES)
    return _checked(stored, raw, MAX_BEAT_BYTES) if raw else None
