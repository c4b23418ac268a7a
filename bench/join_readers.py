"""The readers `rtrl bench join` times on its load, each as a Span: a bare consumer, the
faust floor, reward_stream workers watched through their heartbeats (one round, one kept
up for live rollouts, two in one group), and the Joiner in this process; and the reward
topics read back to check the join was exact."""

from __future__ import annotations

import json
import statistics
import sys
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

import redis
from confluent_kafka import OFFSET_BEGINNING, Consumer, Message, TopicPartition
from confluent_kafka.admin import AdminClient
from rich.progress import Progress

from rtrl import heartbeat, kafka, procs, signing, topics
from rtrl.bench.join_load import (
    PARTITIONS,
    Headers,
    agent_tokens,
    event_signer,
    produce_live,
    rollout_records,
    rollout_signer,
    signed_records,
)
from rtrl.config import StackSettings
from rtrl.reward_stream.authn import Authenticator
from rtrl.reward_stream.config import RewardStreamSettings
from rtrl.reward_stream.runtime import Joiner

TIMEOUT_S = 300.0
QUALITY = ("settled", "defaulted", "late", "dropped", "duplicates")


@dataclass(frozen=True)
class Span:
    """What one throughput measurement saw: how many events, between which instants (s)."""

    events: int
    first_s: float
    last_s: float

    @property
    def events_per_s(self) -> float:
        return (self.events - 1) / max(self.last_s - self.first_s, 1e-3)


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


def faust_floor(
    stack: StackSettings, workdir: Path, expected: int, progress: Progress, round_: int = 0
) -> Span:
    """The bare faust agent through the load, in a fresh group of its own (one per round)."""
    name = f"floor{round_}"
    out, log_file = workdir / f"{name}.json", workdir / f"{name}.log"
    env = worker_env(stack, workdir, f"bench-join-floor-{round_}", name)
    proc = procs.spawn(
        name,
        [sys.executable, "-m", "rtrl.bench.join_floor", str(out), str(expected)],
        log_file,
        env=env,
    )
    task = progress.add_task(f"faust floor, round {round_ + 1}", total=expected)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while True:
            assert proc.alive(), log_file.read_text()[-3000:]
            assert time.monotonic() < deadline, f"faust floor stuck; see {log_file}"
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


class Joiners:
    """``n`` reward_stream workers in one fresh group, watched through their heartbeats;
    ``run`` names the group and the instances apart from an earlier run's."""

    def __init__(self, stack: StackSettings, workdir: Path, n: int, run: str = "") -> None:
        self.instances = [f"join{n}w{run}-{i}" for i in range(n)]
        self.stack, self.workdir = stack, workdir
        self.procs = [
            procs.spawn(
                i,
                [sys.executable, "-m", "rtrl.reward_stream"],
                workdir / f"{i}.log",
                env=worker_env(stack, workdir, f"bench-join-{n}w{run}", i),
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
        deadline = time.monotonic() + TIMEOUT_S
        totals = self._read(client, events, progress, description, deadline)
        self._on_the_broker(client, totals["settled"], description, deadline)
        beats = self.heartbeats(client)
        return Span(
            sum(b.events for b in beats),
            min(b.first_event_ms for b in beats) / 1000,
            max(b.last_event_ms for b in beats) / 1000,
        )

    def _read(
        self,
        client: redis.Redis,
        events: int,
        progress: Progress,
        description: str,
        deadline: float,
    ) -> dict[str, int]:
        """Wait until the workers have read ``events`` records and hold nothing pending;
        returns their totals then."""
        task = progress.add_task(description, total=events)
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
                return totals
            time.sleep(0.1)

    def _on_the_broker(
        self, client: redis.Redis, settled: int, description: str, deadline: float
    ) -> None:
        """Wait until the broker holds the ``settled`` rewards: the counter moves when a
        reward is handed to the producer."""
        tps = [TopicPartition(topics.REWARD, p) for p in range(PARTITIONS)]
        drained_since = None
        while sum((written := kafka.end_offsets(self.stack, tps)).values()) < settled:
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
                f"{description}: {settled} rewards settled, "
                f"{sum(written.values())} on the broker by end offsets, "
                f"{read_back} read back "
                f"({ {tp[1]: end for tp, end in written.items()} }); workers alive {alive}; "
                f"heartbeats {self.heartbeats(client)}; logs in {self.workdir}"
            )
            time.sleep(0.2)

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop(timeout_s=20)


# Produced from the workers' heartbeats, per joiner run (WorkersRun); part of bench/join.py's JoinResult.
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


# Produced by throughput_round, one_worker_and_live and two_workers, per joiner run;
# read by bench/join.py's _result.
@dataclass(frozen=True)
class WorkersRun:
    """One joiner run: what the workers read, their counters, the rewards left on the broker."""

    read: Span
    counts: JoinCounts
    rewards: list[tuple[str, int]]
    """(rollout_id, broker timestamp ms) of every reward record after the run."""
    partitions: tuple[tuple[int, ...], ...] = ()
    """The partitions each worker held (recorded for the two-worker run)."""


def throughput_round(
    stack: StackSettings,
    workdir: Path,
    client: redis.Redis,
    events: int,
    round_: int,
    progress: Progress,
) -> WorkersRun:
    """One worker through the main load in a group of its own, then stopped."""
    one = Joiners(stack, workdir, 1, run=f"r{round_}")
    try:
        read = one.read_until_idle(
            client, events, progress, f"joiner, 1 worker, round {round_ + 1}"
        )
        time.sleep(1.1)  # one more heartbeat, so the counters are final
        counts = JoinCounts.of(one.totals(client))
    finally:
        one.stop()
    return WorkersRun(read, counts, read_rewards(stack))


def one_worker_and_live(
    stack: StackSettings,
    workdir: Path,
    client: redis.Redis,
    events: int,
    live_rollouts: int,
    live_rate_per_s: float,
    progress: Progress,
) -> tuple[WorkersRun, dict[str, int]]:
    """One worker through the main load, then kept up while the live rollouts are produced;
    returns its run and the live rollouts' opening times."""
    one = Joiners(stack, workdir, 1)
    try:
        read = one.read_until_idle(client, events, progress, "joiner, 1 worker")
        opened = produce_live(stack, live_rollouts, live_rate_per_s, progress)
        one.read_until_idle(client, events + 3 * live_rollouts, progress, "live rollouts settling")
        time.sleep(1.1)  # one more heartbeat, so the counters are final
        counts = JoinCounts.of(one.totals(client))
    finally:
        one.stop()
    return WorkersRun(read, counts, read_rewards(stack)), opened


def two_workers(
    stack: StackSettings, workdir: Path, client: redis.Redis, events: int, progress: Progress
) -> WorkersRun:
    """Two workers in one group through everything produced (the reward topics emptied)."""
    two = Joiners(stack, workdir, 2)
    try:
        read = two.read_until_idle(client, events, progress, "joiner, 2 workers")
        time.sleep(1.1)  # one more heartbeat, so the counters are final
        counts = JoinCounts.of(two.totals(client))
        partitions = tuple(tuple(beat.partitions) for beat in two.heartbeats(client))
    finally:
        two.stop()
    return WorkersRun(read, counts, read_rewards(stack), partitions)


def joiner_inprocess(rollouts: int, spacing_ms: int, base_ms: int, checked: bool = False) -> Span:
    """Joiner.feed_record alone on the same load, decoded in this process, each partition's
    records in production order (every topic aligned, as no broker delivers them): the
    ceiling of the join's own CPU cost, without faust or publishing; ``checked``, as the
    service runs it: every record's writer checked, every reward authenticated."""
    settings = RewardStreamSettings()
    signer: signing.HeaderSigner | None = None
    authenticator = None
    if checked:
        signer = settings.reward_seal()
        authenticator = Authenticator.of(settings)
    joiner = Joiner(settings.join_config(), signer=signer, authenticator=authenticator)
    records: list[tuple[str, int, bytes, bytes, Headers]] = []
    rollouts_signer, events_signer = rollout_signer(), event_signer()
    for i in range(rollouts):
        rollout_id = f"r{i:06d}"
        partition = zlib.crc32(rollout_id.encode()) % PARTITIONS
        signed = signed_records(
            rollout_id, base_ms + spacing_ms * i, rollouts_signer, events_signer, agent_tokens(i)
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


def signature_costs(rewards: int = 2_000) -> dict[str, SignatureCost]:
    """Microseconds to authenticate and to check one record of the demo's size, on this
    machine, in this process, by kind, as the services do: a reward (the joiner seals it with
    a MAC for each reader; the trainer checks its own) and a rollout (a worker signs it and
    adds the joiner's MAC; the joiner checks the MAC)."""
    settings = RewardStreamSettings()
    rollouts = [rollout_records(f"s{i:06d}", 0)[0][1] for i in range(rewards)]
    costs: dict[str, SignatureCost] = {}
    for kind, seal, verifier, values in (
        (
            "reward",
            settings.reward_seal(),
            signing.MacVerifier(
                [settings.trainer_mac_key.get_secret_value()], signing.Purpose.REWARD
            ),
            [value * 2 for value in rollouts],  # ~a reward with its rollout
        ),
        (
            "rollout",
            rollout_signer(),
            signing.MacVerifier(
                signing.parse_mac_keys(settings.rollout_mac_keys.get_secret_value()),
                signing.Purpose.ROLLOUT,
            ),
            rollouts,
        ),
    ):
        start = time.perf_counter()
        headers = [seal.headers(value) for value in values]
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
