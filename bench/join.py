"""`rtrl bench join`: reward-join throughput against its floors, scale-out, settle latency.

One run starts its own Tansu and redis-server in a temp dir and produces one load:
``rollouts`` rollouts of three records (a RolloutRecord of ~1.4 KB with 200 token
ids and logprobs, an EditShown and a PersistenceSnapshot of ~0.5 KB), keyed by
rollout_id over 4 partitions, event times ``spacing_ms`` apart (so with the default
2 s window and 0.5 s grace a partition holds a few hundred pending rollouts and
windows close by stream time), then one sentinel rollout per partition whose event
time closes the last windows. Every measurement reads those same topics from the
beginning with a fresh consumer group:

* ``raw_consumer_events_per_s``: a bare confluent-kafka consumer, nothing decoded,
  (events - 1) / (last receipt - first receipt);
* ``faust_floor_events_per_s``: bench.join_floor, a faust agent with the joiner's
  settings that only counts, timed the same way in its own process;
* ``events_per_s``: one ``python -m rtrl.reward_stream`` worker, (events - 1) / (its
  latest read - its first), both clocked by the worker and reported in its heartbeat
  (first_event_ms, last_event_ms): group formation is left out as the floors leave
  out everything before their first record; the read-back of settled rollouts on
  takeover is in. ``settle_events_per_s`` is the other view: 3 x (rollouts - 1) /
  (last main-load reward's broker timestamp - first one's), valid only while the
  join is exact;
* ``joiner_inprocess_events_per_s``: Joiner.feed_record alone on the same records
  in production order, no broker (the join's own CPU cost, its best case);
* ``ratio_vs_floor`` = events_per_s / faust_floor_events_per_s;
* ``scaleout_2_vs_1``: the same for two workers in one group (reward topics emptied
  first, or the second run's read-back would make every record a duplicate);
* ``p50/p99_settle_latency_s``: after the one-worker run has caught up, it stays up
  while ``live_rollouts`` more are produced in real time (event time = wall clock).
  A rollout's window can close at open + window + grace, open being its first
  event's time; its settle latency is its reward's broker timestamp minus that
  instant. Only rollouts closed by later traffic count (open <= last live event
  - window - grace); the last ones close by the wall-clock deadline instead.

Join quality is reported, not assumed: per joiner run, rewards against rollouts
(``exact_*``: missing, doubled) and the workers' counters (settled, defaulted, late,
dropped, duplicates). A backlog is the hard case: a worker reads the four topics
unevenly (whole seconds of one topic's event time before another's), and the join
stays exact only because stream time follows the slowest source still behind and the
wall clock waits until the partition has caught up (reward_stream/join.py). On this
load every count but ``settled`` must be 0.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

import redis
from confluent_kafka import OFFSET_BEGINNING, Consumer, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from rtrl import heartbeat, kafka, procs, signing, topics
from rtrl.bench import report
from rtrl.config import StackSettings
from rtrl.reward_stream.authn import Authenticator
from rtrl.reward_stream.config import RewardStreamSettings
from rtrl.reward_stream.runtime import Joiner
from rtrl.v1 import rollout_pb2, telemetry_pb2

PARTITIONS = 4
TOKENS = 200
EDIT_TEXT = "".join(f"    value_{i} = compute(value_{i - 1}, scale={i})\n" for i in range(1, 12))
SENTINEL = "sentinel-"
LIVE = "live-"
TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Span:
    """What one throughput measurement saw: how many events, between which instants (s)."""

    events: int
    first_s: float
    last_s: float

    @property
    def events_per_s(self) -> float:
        return (self.events - 1) / max(self.last_s - self.first_s, 1e-3)


Headers = list[tuple[str, bytes]]
"""A record's Kafka headers, as the joiner reads them (produced through
rtrl.kafka.kafka_headers, which types them as confluent_kafka's produce() wants)."""


def rollout_signer() -> signing.Signer:
    """The inference workers' rollout signer: the joiners verify every rollout (run() makes
    a key pair for the bench unless the environment holds one)."""
    return signing.Signer(os.environ["RTRL_INFERENCE_ROLLOUT_SIGNING_KEY"], signing.Purpose.ROLLOUT)


def event_signer() -> signing.MacSigner:
    """The gateway's event authenticator: the joiners verify every event (run() makes a key
    for the bench unless the environment holds one)."""
    return signing.MacSigner(os.environ["RTRL_INGEST_EVENT_KEY"], signing.Purpose.EVENT)


def signed_records(
    rollout_id: str, ts_ms: int, signer: signing.Signer, events: signing.MacSigner
) -> list[tuple[str, bytes, Headers]]:
    """rollout_records with the headers their writers send: the rollout signed as a worker
    signs it, each event authenticated as the gateway does."""
    return [
        (topic, value, list((signer if topic == topics.ROLLOUT else events).headers(value)))
        for topic, value in rollout_records(rollout_id, ts_ms)
    ]


def rollout_records(rollout_id: str, ts_ms: int) -> list[tuple[str, bytes]]:
    """The three records of one rollout, as (topic, value)."""
    record = rollout_pb2.RolloutRecord(
        event_id=str(uuid.uuid4()),
        rollout_id=rollout_id,
        session_id="bench",
        client_ts_ms=ts_ms,
        model_name="bench-policy",
        completion_text=EDIT_TEXT[:200],
        latency_s=0.4,
        completion_token_ids=[(7919 * i) % 50_000 for i in range(TOKENS)],
        completion_logprobs=[-0.01 * (i % 97) for i in range(TOKENS)],
    )
    shown = telemetry_pb2.TelemetryEvent(
        event_id=str(uuid.uuid4()),
        rollout_id=rollout_id,
        session_id="bench",
        client_ts_ms=ts_ms + 1,
        edit_shown=telemetry_pb2.EditShown(file_path="src/bench.py", edit_text=EDIT_TEXT),
    )
    kept = telemetry_pb2.TelemetryEvent(
        event_id=str(uuid.uuid4()),
        rollout_id=rollout_id,
        session_id="bench",
        client_ts_ms=ts_ms + 2,
        persistence=telemetry_pb2.PersistenceSnapshot(seconds_after_edit=30, region_text=EDIT_TEXT),
    )
    return [
        (topics.ROLLOUT, record.SerializeToString()),
        (topics.EDIT, shown.SerializeToString()),
        (topics.PERSISTENCE, kept.SerializeToString()),
    ]


def produce_load(
    stack: StackSettings,
    rollouts: int,
    spacing_ms: int,
    base_ms: int,
    close_after_ms: int,
    progress: Progress,
) -> tuple[list[str], int]:
    """The main load plus one sentinel per partition; returns the rollout ids and the bytes produced."""
    producer = Producer(
        kafka.producer_config(stack, **{"linger.ms": 20, "queue.buffering.max.messages": 200_000})
    )
    task = progress.add_task("producing", total=rollouts)
    signer, events = rollout_signer(), event_signer()
    ids, size = [], 0
    for i in range(rollouts):
        rollout_id = f"r{i:06d}"
        for topic, value, headers in signed_records(
            rollout_id, base_ms + spacing_ms * i, signer, events
        ):
            producer.produce(topic, value, key=rollout_id, headers=kafka.kafka_headers(headers))
            size += len(value)
        ids.append(rollout_id)
        if i % 500 == 0:
            producer.poll(0)
            progress.update(task, completed=i)
    # Explicit partitions: a sentinel must advance every partition's stream time.
    end_ms = base_ms + spacing_ms * rollouts + close_after_ms
    for partition in range(PARTITIONS):
        rollout_id = f"{SENTINEL}{partition}"
        for topic, value, headers in signed_records(rollout_id, end_ms, signer, events):
            producer.produce(
                topic,
                value,
                key=rollout_id,
                partition=partition,
                headers=kafka.kafka_headers(headers),
            )
        ids.append(rollout_id)
    assert producer.flush(60) == 0, "the broker did not take the load"
    progress.update(task, completed=rollouts)
    return ids, size


def raw_consume(stack: StackSettings, expected: int, progress: Progress) -> Span:
    consumer = Consumer(kafka.consumer_config(stack, f"bench-join-raw-{uuid.uuid4().hex[:8]}"))
    consumer.subscribe(list(topics.TELEMETRY))
    task = progress.add_task("raw consumer", total=expected)
    count, first = 0, None
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while count < expected:
            assert time.monotonic() < deadline, f"raw consumer read {count} of {expected}"
            batch = consumer.consume(1000, timeout=0.5)
            now = time.time()
            got = sum(1 for m in batch if m.error() is None)
            if got and first is None:
                first = now
            count += got
            progress.update(task, completed=count)
        assert first is not None  # set with the first batch that held events
        return Span(count, first, now)
    finally:
        consumer.close()


def worker_env(stack: StackSettings, workdir: Path, app_id: str, instance: str) -> dict[str, str]:
    return {
        "RTRL_KAFKA_BOOTSTRAP": stack.kafka_bootstrap,
        "RTRL_REDIS_URL": stack.redis_url,
        "RTRL_STATE_DIR": str(workdir / instance),
        "RTRL_KAFKA_PARTITIONS": str(PARTITIONS),
        "RTRL_INSTANCE": instance,
        "RTRL_REWARD_APP_ID": app_id,
        "RTRL_REWARD_WEB_PORT": str(procs.free_port()),
    }


def faust_floor(stack: StackSettings, workdir: Path, expected: int, progress: Progress) -> Span:
    out = workdir / "floor.json"
    env = worker_env(stack, workdir, "bench-join-floor", "floor")
    proc = procs.spawn(
        "floor",
        [sys.executable, "-m", "rtrl.bench.join_floor", str(out), str(expected)],
        workdir / "floor.log",
        env=env,
    )
    task = progress.add_task("faust floor", total=expected)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while True:
            assert proc.alive(), (workdir / "floor.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"faust floor stuck; see {workdir / 'floor.log'}"
            counted = json.loads(out.read_text()) if out.exists() else {"events": 0}
            progress.update(task, completed=counted["events"])
            if counted["events"] >= expected:
                return Span(counted["events"], counted["first_s"], counted["last_s"])
            time.sleep(0.2)
    finally:
        proc.stop()


def read_rewards(stack: StackSettings) -> list[tuple[str, int]]:
    """(rollout_id, broker timestamp ms) of every reward record, read by assignment."""
    tps = [TopicPartition(topics.REWARD, p) for p in range(PARTITIONS)]
    ends = kafka.end_offsets(stack, tps)
    remaining = {k for k, end in ends.items() if end > 0}
    consumer = Consumer(
        kafka.client_config(stack, **{"group.id": "bench-join-read", "enable.auto.commit": False})
    )
    consumer.assign([TopicPartition(tp.topic, tp.partition, OFFSET_BEGINNING) for tp in tps])
    rewards = []
    deadline = time.monotonic() + 60
    try:
        while remaining:
            assert time.monotonic() < deadline, (
                f"could not read rewards up to the end of {remaining}"
            )
            for msg in consumer.consume(1000, timeout=0.2):
                if msg.error() is None:
                    topic, partition, offset = kafka.record_position(msg)
                    rewards.append((reward_key(msg), msg.timestamp()[1]))
                    if offset + 1 >= ends[(topic, partition)]:
                        remaining.discard((topic, partition))
    finally:
        consumer.close()
    return rewards


def reward_key(msg: Message) -> str:
    """A reward record's key: the rollout_id it settles (the joiner keys every reward)."""
    key = msg.key()
    assert key is not None, f"a reward record without a key at {kafka.record_position(msg)}"
    return key.decode()


def read_all_rewards(stack: StackSettings, idle_s: float = 3.0) -> str:
    """Every reward record, read until none came for ``idle_s`` (end offsets not trusted):
    a diagnosis when the broker seems to hold fewer rewards than the workers settled."""
    consumer = Consumer(
        kafka.client_config(
            stack, **{"group.id": "bench-join-diagnosis", "enable.auto.commit": False}
        )
    )
    consumer.assign([TopicPartition(topics.REWARD, p, OFFSET_BEGINNING) for p in range(PARTITIONS)])
    keys: list[str] = []
    offsets: dict[int, int] = {}
    last = time.monotonic()
    try:
        while time.monotonic() - last < idle_s:
            for msg in consumer.consume(1000, timeout=0.2):
                if msg.error() is None:
                    _, partition, offset = kafka.record_position(msg)
                    keys.append(reward_key(msg))
                    offsets[partition] = max(offsets.get(partition, -1), offset)
                    last = time.monotonic()
    finally:
        consumer.close()
    return f"{len(keys)} records, {len(set(keys))} rollouts, last offsets {dict(sorted(offsets.items()))}"


# Produced by exactness, per joiner run; part of JoinResult.
@dataclass(frozen=True)
class Exactness:
    """How far the rewards on the broker are from one per rollout."""

    missing: int
    """Rollouts without a reward."""
    doubled: int
    """Rewards beyond the first for their rollout."""


def exactness(rewards: list[tuple[str, int]], ids: list[str]) -> Exactness:
    """How far the rewards are from one per rollout: rollouts without one, extra rewards."""
    got = [rollout_id for rollout_id, _ in rewards]
    return Exactness(missing=len(set(ids) - set(got)), doubled=len(got) - len(set(got)))


def rewards_span(rewards: list[tuple[str, int]], main_ids: set[str]) -> Span:
    """Rollouts settle as the joiner reads them, three events each: the settle rate of the
    main load, from its first reward's broker timestamp to its last one's."""
    stamps = sorted(ts for rollout_id, ts in rewards if rollout_id in main_ids)
    return Span(3 * len(stamps) - 2, stamps[0] / 1000, stamps[-1] / 1000)


QUALITY = ("settled", "defaulted", "late", "dropped", "duplicates")


# Produced by run from the workers' heartbeats, per joiner run; part of JoinResult.
@dataclass(frozen=True)
class JoinCounts:
    """The QUALITY counters of a run's workers, summed: on the bench's load all but settled are 0."""

    settled: int
    defaulted: int
    late: int
    dropped: int
    duplicates: int

    @classmethod
    def of(cls, totals: dict[str, int]) -> JoinCounts:
        """From Joiners.totals."""
        return cls(
            settled=totals["settled"],
            defaulted=totals["defaulted"],
            late=totals["late"],
            dropped=totals["dropped"],
            duplicates=totals["duplicates"],
        )


class Joiners:
    """``n`` reward_stream workers in one fresh group, watched through their heartbeats."""

    def __init__(self, stack: StackSettings, workdir: Path, n: int) -> None:
        self.instances = [f"join{n}w-{i}" for i in range(n)]
        self.stack, self.workdir = stack, workdir
        self.procs = [
            procs.spawn(
                i,
                [sys.executable, "-m", "rtrl.reward_stream"],
                workdir / f"{i}.log",
                env=worker_env(stack, workdir, f"bench-join-{n}w", i),
            )
            for i in self.instances
        ]

    def heartbeats(self, client: redis.Redis) -> list[heartbeat.RewardStreamBeat]:
        found = (heartbeat.read_one(client, "reward_stream", i) for i in self.instances)
        return [
            beat.beat
            for beat in found
            if beat is not None and isinstance(beat.beat, heartbeat.RewardStreamBeat)
        ]

    def totals(self, client: redis.Redis) -> dict[str, int]:
        beats = self.heartbeats(client)
        totals = {
            k: sum(getattr(beat, k) for beat in beats) for k in ("events", "pending", *QUALITY)
        }
        return {**totals, "beats": len(beats)}

    def read_until_idle(
        self, client: redis.Redis, events: int, progress: Progress, description: str
    ) -> Span:
        """Wait until the workers have read ``events`` records and hold nothing pending, and
        every reward they settled is on the broker.

        Returns the span from the workers' first read to their latest, as they clock it
        themselves to the millisecond (the heartbeats only say when to look, once a second:
        too coarse to time a run of ten)."""
        task = progress.add_task(description, total=events)
        deadline = time.monotonic() + TIMEOUT_S
        done = False
        while True:
            totals = self.totals(client)
            for proc in self.procs:
                assert proc.alive(), (self.workdir / f"{proc.name}.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (
                f"{description}: {totals} after {TIMEOUT_S:.0f} s; logs in {self.workdir}"
            )
            done = done or totals["events"] >= events
            progress.update(task, completed=min(totals["events"], events))
            if done and totals["pending"] == 0 and totals["beats"] == len(self.instances):
                break
            time.sleep(0.1)
        # The counter moves when a reward is handed to the producer; wait until the broker holds them.
        tps = [TopicPartition(topics.REWARD, p) for p in range(PARTITIONS)]
        drained_since = None
        while sum((written := kafka.end_offsets(self.stack, tps)).values()) < totals["settled"]:
            alive = [proc.alive() for proc in self.procs]
            # Nothing left in the workers' producers: what is missing now will not come.
            if all(beat.in_flight == 0 for beat in self.heartbeats(client)):
                drained_since = drained_since or time.monotonic()
            else:
                drained_since = None
            if drained_since and time.monotonic() - drained_since > 15:
                deadline = 0.0
            read_back = (
                read_all_rewards(self.stack)
                if time.monotonic() > deadline or not all(alive)
                else None
            )
            assert time.monotonic() < deadline and all(alive), (
                f"{description}: {totals['settled']} rewards settled, "
                f"{sum(written.values())} on the broker by end offsets, "
                f"{read_back} read back "
                f"({ {tp[1]: end for tp, end in written.items()} }); workers alive {alive}; "
                f"heartbeats {self.heartbeats(client)}; logs in {self.workdir}"
            )
            time.sleep(0.2)
        beats = self.heartbeats(client)
        return Span(
            sum(b.events for b in beats),
            min(b.first_event_ms for b in beats) / 1000,
            max(b.last_event_ms for b in beats) / 1000,
        )

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop(timeout_s=20)


def produce_live(
    stack: StackSettings, rollouts: int, rate_per_s: float, progress: Progress
) -> dict[str, int]:
    """Rollouts produced in real time; returns rollout_id -> event time of its first event."""
    producer = Producer(kafka.producer_config(stack))
    task = progress.add_task("live rollouts", total=rollouts)
    opened, start = {}, time.monotonic()
    signer, events = rollout_signer(), event_signer()
    for i in range(rollouts):
        time.sleep(max(0.0, start + i / rate_per_s - time.monotonic()))
        rollout_id = f"{LIVE}{i:06d}"
        opened[rollout_id] = int(time.time() * 1000)
        for topic, value, headers in signed_records(rollout_id, opened[rollout_id], signer, events):
            producer.produce(topic, value, key=rollout_id, headers=kafka.kafka_headers(headers))
        producer.poll(0)
        progress.update(task, completed=i + 1)
    assert producer.flush(30) == 0
    return opened


def settle_latencies(
    rewards: list[tuple[str, int]], opened: dict[str, int], close_after_ms: int
) -> list[float]:
    last_open = max(opened.values())
    return sorted(
        (ts - opened[rollout_id] - close_after_ms) / 1000
        for rollout_id, ts in rewards
        if rollout_id in opened and opened[rollout_id] <= last_open - close_after_ms
    )


def empty_reward_topics(stack: StackSettings) -> None:
    admin = AdminClient(kafka.client_config(stack))
    outputs = [topics.REWARD, topics.REWARD_LATE, topics.REWARD_DLQ]
    for future in admin.delete_topics(outputs).values():
        future.result(timeout=20)
    deadline = time.monotonic() + 20
    while set(outputs) & set(admin.list_topics(timeout=5).topics):
        assert time.monotonic() < deadline, "reward topics still listed after deletion"
        time.sleep(0.1)
    kafka.ensure_topics(stack)


def joiner_inprocess(
    rollouts: int, spacing_ms: int, base_ms: int, reward_key: str | None = None
) -> Span:
    """Joiner.feed_record alone on the same load, decoded in this process, each partition's
    records in production order (every topic aligned, as no broker delivers them): the
    ceiling of the join's own CPU cost, without faust or publishing; with ``reward_key``,
    as the service runs it: every rollout verified, every reward signed."""
    settings = RewardStreamSettings()
    signer = authenticator = None
    if reward_key is not None:
        signer = signing.Signer(reward_key, signing.Purpose.REWARD)
        authenticator = Authenticator.of(settings, "the bench's joiner")
    joiner = Joiner(settings.join_config(), signer=signer, authenticator=authenticator)
    records: list[tuple[str, int, bytes, bytes, Headers]] = []
    rollouts_signer, events_signer = rollout_signer(), event_signer()
    for i in range(rollouts):
        rollout_id = f"r{i:06d}"
        partition = zlib.crc32(rollout_id.encode()) % PARTITIONS
        signed = signed_records(
            rollout_id, base_ms + spacing_ms * i, rollouts_signer, events_signer
        )
        records.extend(
            (topic, partition, rollout_id.encode(), value, headers)
            for topic, value, headers in signed
        )
    now_ms = int(time.time() * 1000)
    start = time.perf_counter()
    for offset, (topic, partition, key, value, headers) in enumerate(records):
        joiner.feed_record(topic, partition, offset, key, value, now_ms, offset, headers=headers)
    assert joiner.counters.unauthenticated == 0
    elapsed = time.perf_counter() - start
    return Span(len(records), 0.0, elapsed)


@dataclass(frozen=True)
class SignatureCost:
    """signature_costs' figures for one kind of record; run puts them in JoinResult's
    sign_us_per_<kind>, verify_us_per_<kind> and <kind>_bytes."""

    sign_us: float
    verify_us: float
    bytes: int
    """The records' mean size."""


def signature_costs(key: str, rewards: int = 2_000) -> dict[str, SignatureCost]:
    """Microseconds to sign and to verify one record of the demo's size, on this machine, in
    this process, by kind: a reward (the joiner signs, the trainer verifies) and a rollout
    (a worker signs, the joiner verifies)."""
    rollouts = [rollout_records(f"s{i:06d}", 0)[0][1] for i in range(rewards)]
    costs: dict[str, SignatureCost] = {}
    for kind, purpose, values in (
        (
            "reward",
            signing.Purpose.REWARD,
            [value * 2 for value in rollouts],
        ),  # ~a reward with its rollout
        ("rollout", signing.Purpose.ROLLOUT, rollouts),
    ):
        signer, verifier = (
            signing.Signer(key, purpose),
            signing.Verifier([signing.public_key_of(key)], purpose),
        )
        start = time.perf_counter()
        headers = [signer.headers(value) for value in values]
        signed = time.perf_counter() - start
        start = time.perf_counter()
        problems = [
            verifier.problem(value, header) for value, header in zip(values, headers, strict=True)
        ]
        verified = time.perf_counter() - start
        assert not any(problems)
        costs[kind] = SignatureCost(
            sign_us=round(signed / len(values) * 1e6, 1),
            verify_us=round(verified / len(values) * 1e6, 1),
            bytes=round(statistics.fmean(len(v) for v in values)),
        )
    return costs


def code_version(watched: str = "reward_stream") -> str:
    """The commit measured (``+dirty`` when ``watched`` differs from it; empty outside a
    git checkout): the code changes under a benchmark, so a figure names its code."""
    repo = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=repo, capture_output=True, text=True, check=False
        ).stdout.strip()

    head = git("rev-parse", "--short", "HEAD")
    return f"{head}+dirty" if head and git("status", "--porcelain", "--", watched) else head


def percentile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


# Produced by run; written to bench/results/join.json; read by its test and the README.
# Rates are events per second as the module docstring defines them.
@dataclass(frozen=True)
class JoinResult:
    code: str
    """The commit of reward_stream/ the join ran at."""
    rollouts: int
    """Rollouts in the main load (sentinels and live rollouts not counted)."""
    events: int
    """Records in the main load with its sentinels: three per rollout."""
    mean_event_bytes: int
    partitions: int
    spacing_ms: int
    """Event time between consecutive rollouts of the main load."""
    window_s: float
    grace_s: float
    raw_consumer_events_per_s: int
    faust_floor_events_per_s: int
    joiner_inprocess_events_per_s: int
    joiner_inprocess_signed_events_per_s: int
    """The same with every rollout verified and every reward signed, as the service runs it."""
    signed_vs_unsigned_inprocess: float
    sign_us_per_reward: float
    """Microseconds for the joiner to sign a reward of reward_bytes."""
    verify_us_per_reward: float
    """Microseconds for the trainer to verify it."""
    reward_bytes: int
    sign_us_per_rollout: float
    """Microseconds for a worker to sign a rollout of rollout_bytes."""
    verify_us_per_rollout: float
    """Microseconds for the joiner to verify it."""
    rollout_bytes: int
    events_per_s: int
    """One reward_stream worker, clocked by itself."""
    events_per_s_2_workers: int
    ratio_vs_floor: float
    floor_vs_raw: float
    scaleout_2_vs_1: float
    rate_source: str
    """Whose clocks time events_per_s: the workers'."""
    settle_events_per_s: int
    """The main load's settle rate by the rewards' broker timestamps, 1 worker."""
    settle_events_per_s_2_workers: int
    rewards_1_worker: int
    """Reward records on the broker after the 1-worker run."""
    rewards_2_workers: int
    exact_1_worker: Exactness
    exact_2_workers: Exactness
    join_1_worker: JoinCounts
    join_2_workers: JoinCounts
    partitions_2_workers: tuple[tuple[int, ...], ...]
    """The partitions each of the two workers held."""
    live_rollouts: int
    live_rate_per_s: float
    latency_samples: int
    """Live rollouts closed by later traffic: those p50/p99_settle_latency_s are over."""
    p50_settle_latency_s: float
    p99_settle_latency_s: float


def run(
    out: Path,
    console: Console,
    rollouts: int = 20_000,
    spacing_ms: int = 2,
    live_rollouts: int = 2_000,
    live_rate_per_s: float = 250.0,
) -> JoinResult:
    # The bench's joiners (which inherit this environment) sign with a key made for the run
    # unless one is set: the service has no default key.
    key = os.environ.setdefault("RTRL_REWARD_SIGNING_KEY", signing.generate_private_key())
    rollout_key = os.environ.setdefault(
        "RTRL_INFERENCE_ROLLOUT_SIGNING_KEY", signing.generate_private_key()
    )
    os.environ.setdefault("RTRL_REWARD_ROLLOUT_PUBLIC_KEYS", signing.public_key_of(rollout_key))
    event_key = os.environ.setdefault("RTRL_INGEST_EVENT_KEY", signing.generate_mac_key())
    os.environ.setdefault("RTRL_REWARD_EVENT_KEYS", event_key)
    join_settings = RewardStreamSettings()
    code = code_version()
    close_after_ms = round((join_settings.window_s + join_settings.grace_s) * 1000)
    if live_rollouts / live_rate_per_s <= 1.2 * close_after_ms / 1000:
        raise ValueError(
            "live rollouts must keep coming well past one window + grace "
            f"({close_after_ms} ms) to close any by stream time"
        )
    with tempfile.TemporaryDirectory(prefix="rtrl-bench-join-") as tmp:
        workdir = Path(tmp)
        tansu = procs.start_tansu(workdir / "tansu.log")
        redis_proc = procs.start_redis(workdir / "redis", workdir / "redis.log")
        stack = StackSettings(
            kafka_bootstrap=f"127.0.0.1:{tansu.port}",
            redis_url=f"redis://127.0.0.1:{redis_proc.port}/0",
            kafka_partitions=PARTITIONS,
            state_dir=workdir / "state",
        )
        client = redis.Redis.from_url(stack.redis_url)
        try:
            kafka.ensure_topics(stack)
            with Progress(console=console, transient=True) as progress:
                # Event time ends well before now, so the live rollouts' windows start fresh.
                base_ms = int(time.time() * 1000) - spacing_ms * rollouts - 10 * close_after_ms
                ids, load_bytes = produce_load(
                    stack, rollouts, spacing_ms, base_ms, close_after_ms, progress
                )
                events = 3 * len(ids)
                with console.status("joiner in-process, then signing each reward"):
                    inprocess = joiner_inprocess(rollouts, spacing_ms, base_ms)
                    inprocess_signed = joiner_inprocess(rollouts, spacing_ms, base_ms, key)
                    signatures = signature_costs(key)
                raw = raw_consume(stack, events, progress)
                floor = faust_floor(stack, workdir, events, progress)
                main_ids = {i for i in ids if not i.startswith(SENTINEL)}

                one = Joiners(stack, workdir, 1)
                try:
                    read_one = one.read_until_idle(client, events, progress, "joiner, 1 worker")
                    opened = produce_live(stack, live_rollouts, live_rate_per_s, progress)
                    one.read_until_idle(
                        client, events + 3 * live_rollouts, progress, "live rollouts settling"
                    )
                    time.sleep(1.1)  # one more heartbeat, so the counters are final
                    quality_one = one.totals(client)
                finally:
                    one.stop()
                ids += list(opened)
                rewards_one = read_rewards(stack)
                latencies = settle_latencies(rewards_one, opened, close_after_ms)

                empty_reward_topics(stack)
                two = Joiners(stack, workdir, 2)
                try:
                    read_two = two.read_until_idle(
                        client, events + 3 * live_rollouts, progress, "joiner, 2 workers"
                    )
                    time.sleep(1.1)  # one more heartbeat, so the counters are final
                    quality_two = two.totals(client)
                    partitions_two = tuple(
                        tuple(beat.partitions) for beat in two.heartbeats(client)
                    )
                finally:
                    two.stop()
                rewards_two = read_rewards(stack)
        finally:
            client.close()
            redis_proc.stop()
            tansu.stop()
    settle_one, settle_two = (
        rewards_span(rewards_one, main_ids),
        rewards_span(rewards_two, main_ids),
    )
    one_rate, two_rate = read_one.events_per_s, read_two.events_per_s
    reward, rollout = signatures["reward"], signatures["rollout"]
    result = JoinResult(
        code=code,
        rollouts=rollouts,
        events=events,
        mean_event_bytes=round(load_bytes / (3 * rollouts)),
        partitions=PARTITIONS,
        spacing_ms=spacing_ms,
        window_s=join_settings.window_s,
        grace_s=join_settings.grace_s,
        raw_consumer_events_per_s=round(raw.events_per_s),
        faust_floor_events_per_s=round(floor.events_per_s),
        joiner_inprocess_events_per_s=round(inprocess.events_per_s),
        joiner_inprocess_signed_events_per_s=round(inprocess_signed.events_per_s),
        signed_vs_unsigned_inprocess=round(
            inprocess_signed.events_per_s / inprocess.events_per_s, 3
        ),
        sign_us_per_reward=reward.sign_us,
        verify_us_per_reward=reward.verify_us,
        reward_bytes=reward.bytes,
        sign_us_per_rollout=rollout.sign_us,
        verify_us_per_rollout=rollout.verify_us,
        rollout_bytes=rollout.bytes,
        events_per_s=round(one_rate),
        events_per_s_2_workers=round(two_rate),
        ratio_vs_floor=round(one_rate / floor.events_per_s, 3),
        floor_vs_raw=round(floor.events_per_s / raw.events_per_s, 3),
        scaleout_2_vs_1=round(two_rate / one_rate, 3),
        rate_source="worker clocks",
        settle_events_per_s=round(settle_one.events_per_s),
        settle_events_per_s_2_workers=round(settle_two.events_per_s),
        rewards_1_worker=len(rewards_one),
        rewards_2_workers=len(rewards_two),
        exact_1_worker=exactness(rewards_one, ids),
        exact_2_workers=exactness(rewards_two, ids),
        join_1_worker=JoinCounts.of(quality_one),
        join_2_workers=JoinCounts.of(quality_two),
        partitions_2_workers=partitions_two,
        live_rollouts=live_rollouts,
        live_rate_per_s=live_rate_per_s,
        latency_samples=len(latencies),
        p50_settle_latency_s=round(statistics.median(latencies), 4),
        p99_settle_latency_s=round(percentile(latencies, 0.99), 4),
    )
    report.write(out, result)
    _print(result, out, console)
    return result


def _print(r: JoinResult, out: Path, console: Console) -> None:
    load = f"{r.events:,} events of ~{r.mean_event_bytes} B, {r.partitions} partitions"
    table = Table(title=f"bench join -> {out} ({load})", title_justify="left")
    for column in ("reader", "events/s", "vs faust floor", "vs raw consumer"):
        table.add_column(column, justify="right")
    floor, raw = r.faust_floor_events_per_s, r.raw_consumer_events_per_s
    for name, rate in (
        ("raw confluent-kafka consumer", raw),
        ("bare faust agent (floor)", floor),
        ("Joiner.feed_record in-process, aligned", r.joiner_inprocess_events_per_s),
        (
            "... verifying every rollout, signing every reward (Ed25519)",
            r.joiner_inprocess_signed_events_per_s,
        ),
        ("reward_stream, 1 worker", r.events_per_s),
        ("reward_stream, 2 workers", r.events_per_s_2_workers),
    ):
        table.add_row(name, f"{rate:,}", f"{rate / floor:.2f}", f"{rate / raw:.3f}")
    console.print(table)
    all_rollouts = r.rollouts + r.partitions + r.live_rollouts
    for workers, rewards, e, j in (
        ("1 worker", r.rewards_1_worker, r.exact_1_worker, r.join_1_worker),
        ("2 workers", r.rewards_2_workers, r.exact_2_workers, r.join_2_workers),
    ):
        console.print(
            f"{workers}: {rewards:,} rewards for {all_rollouts:,} rollouts "
            f"({e.missing:,} missing, {e.doubled:,} doubled); join: {j.settled:,} settled, "
            f"{j.defaulted:,} defaulted, {j.late:,} late, {j.dropped:,} dropped"
        )
    console.print(
        f"signatures: {r.sign_us_per_reward} us to sign a {r.reward_bytes:,}-byte reward (the joiner), "
        f"{r.verify_us_per_reward} us to verify it (the trainer); {r.sign_us_per_rollout} us to sign a "
        f"{r.rollout_bytes:,}-byte rollout (a worker), {r.verify_us_per_rollout} us to verify it (the joiner); "
        f"signed/unsigned in-process {r.signed_vs_unsigned_inprocess}"
    )
    console.print(
        f"ratio_vs_floor {r.ratio_vs_floor:.2f} (target >= 0.8), "
        f"scaleout_2_vs_1 {r.scaleout_2_vs_1:.2f} (target >= 1.6), "
        f"settle latency p50 {r.p50_settle_latency_s * 1000:.0f} ms, "
        f"p99 {r.p99_settle_latency_s * 1000:.0f} ms "
        f"over {r.latency_samples} live rollouts at {r.live_rate_per_s:g}/s"
    )
