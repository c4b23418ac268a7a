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
* ``ratio_vs_floor`` = events_per_s / faust_floor_events_per_s, each the best of
  ``rounds`` rounds that alternate the floor and one worker, each round in a fresh group
  with the reward topics emptied (one faust run on this machine varies by a third from
  the next; every round is in the result);
* ``scaleout_2_vs_1``: the same for two workers in one group (reward topics emptied
  first, or the second run's read-back would make every record a duplicate);
* ``p50/p99_settle_latency_s``: after the one-worker run has caught up, it stays up
  while ``live_rollouts`` more are produced in real time (event time = wall clock).
  A rollout's window can close at open + window + grace, open being its first
  event's time; its settle latency is its reward's broker timestamp minus that
  instant. Only rollouts closed by later traffic count (open <= last live event
  - window - grace); the last ones close by the wall-clock deadline instead.

One rollout in twenty of the main load is an agent's trajectory, of 4k or 32k tokens, as
its worker writes it (bulk out of band: bench/agent_load.py), so every exactness count
below covers them. Each kind is also measured alone (bench/join_trajectories.py): joined
in-process with every check on and every record delivered twice, with the joiner's memory
per pending rollout and for a 10-minute window at the demo's rate.

Join quality is reported, not assumed: per joiner run, rewards against rollouts
(``exact_*``: missing, doubled) and the workers' counters (settled, defaulted, late,
dropped, duplicates). A backlog is the hard case: a worker reads the four topics
unevenly (whole seconds of one topic's event time before another's), and the join
stays exact only because stream time follows the slowest source still behind and the
wall clock waits until the partition has caught up (reward_stream/join.py). On this
load every count but ``settled`` must be 0.

The load and its keys are bench/join_load.py's, the readers and the read-back of rewards
bench/join_readers.py's; this module runs them in order and makes the result.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import redis
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from rtrl import kafka
from rtrl.bench import join_trajectories, report
from rtrl.bench.join_load import PARTITIONS, SENTINEL, produce_load, signing_keys
from rtrl.bench.join_readers import (
    JoinCounts,
    SignatureCost,
    Span,
    WorkersRun,
    empty_reward_topics,
    faust_floor,
    joiner_inprocess,
    one_worker_and_live,
    raw_consume,
    signature_costs,
    throughput_round,
    two_workers,
)
from rtrl.bench.join_trajectories import TrajectoryLoad
from rtrl.bench.report import code_version
from rtrl.bench.stack import scratch_stack
from rtrl.config import StackSettings
from rtrl.reward_stream.config import RewardStreamSettings


# Produced by run from its arguments and the joiner's window; read by every phase of run.
@dataclass(frozen=True)
class Load:
    """What run produces: the main load, then the live rollouts."""

    rollouts: int
    spacing_ms: int
    live_rollouts: int
    live_rate_per_s: float
    close_after_ms: int
    """The joiner's window plus grace: how long after its first event a rollout can close."""

    def __post_init__(self) -> None:
        if self.live_rollouts / self.live_rate_per_s <= 1.2 * self.close_after_ms / 1000:
            raise ValueError(
                "live rollouts must keep coming well past one window + grace "
                f"({self.close_after_ms} ms) to close any by stream time"
            )


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


def settle_latencies(
    rewards: list[tuple[str, int]], opened: dict[str, int], close_after_ms: int
) -> list[float]:
    last_open = max(opened.values())
    return sorted(
        (ts - opened[rollout_id] - close_after_ms) / 1000
        for rollout_id, ts in rewards
        if rollout_id in opened and opened[rollout_id] <= last_open - close_after_ms
    )


def percentile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


# Produced by run; written to bench/results/join.json; read by its test and docs/benchmarks.md.
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
    rounds: int
    """Rounds of the floor and of one worker, alternating: each rate below is the best."""
    faust_floor_events_per_s: int
    faust_floor_rounds: tuple[int, ...]
    joiner_inprocess_events_per_s: int
    joiner_inprocess_signed_events_per_s: int
    """The same with every record's writer checked and every reward authenticated, as the
    service runs it."""
    signed_vs_unsigned_inprocess: float
    sign_us_per_reward: float
    """Microseconds for the joiner to authenticate a reward of reward_bytes (a MAC for each
    reader: the trainer, the analytics sink)."""
    verify_us_per_reward: float
    """Microseconds for the trainer to check its MAC."""
    reward_bytes: int
    sign_us_per_rollout: float
    """Microseconds for a worker to authenticate a rollout of rollout_bytes (its signature
    and the joiner's MAC)."""
    verify_us_per_rollout: float
    """Microseconds for the joiner to check its MAC."""
    rollout_bytes: int
    events_per_s: int
    """One reward_stream worker, clocked by itself."""
    events_per_s_rounds: tuple[int, ...]
    """Every round's; the last round's worker stays up for the live rollouts."""
    exact_1_worker_rounds: tuple[Exactness, ...]
    """Each round's rewards against its rollouts (the last is exact_1_worker)."""
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
    trajectories: tuple[TrajectoryLoad, ...] = ()
    """Agent trajectories of 4k and 32k tokens beside the single-turn rollout, joined
    in-process as the service joins them (bench/join_trajectories.py)."""


# Produced by _measure; read by _result.
@dataclass(frozen=True)
class Measured:
    """Everything one run measured on its stack, before it becomes a JoinResult."""

    ids: list[str]
    """Every rollout produced: the main load, its sentinels, the live rollouts."""
    main_ids: set[str]
    load_bytes: int
    events: int
    """Records in the main load with its sentinels."""
    inprocess: Span
    inprocess_signed: Span
    signatures: dict[str, SignatureCost]
    raw: Span
    floors: list[Span]
    earlier_ones: list[WorkersRun]
    """The one-worker rounds before the last (``one``)."""
    one: WorkersRun
    two: WorkersRun
    latencies: list[float]
    trajectories: tuple[TrajectoryLoad, ...]


def run(
    out: Path,
    console: Console,
    rollouts: int = 20_000,
    spacing_ms: int = 2,
    live_rollouts: int = 2_000,
    live_rate_per_s: float = 250.0,
    rounds: int = 3,
    trajectory_rollouts: int = 500,
) -> JoinResult:
    signing_keys()
    join_settings = RewardStreamSettings()
    code = code_version()
    load = Load(
        rollouts,
        spacing_ms,
        live_rollouts,
        live_rate_per_s,
        close_after_ms=round((join_settings.window_s + join_settings.grace_s) * 1000),
    )
    with tempfile.TemporaryDirectory(prefix="rtrl-bench-join-") as tmp:
        workdir = Path(tmp)
        with scratch_stack(workdir, kafka_partitions=PARTITIONS) as stack:
            measured = _measure(stack, workdir, load, console, rounds, trajectory_rollouts)
    result = _result(measured, load, join_settings, code)
    report.write(out, result)
    _print(result, out, console)
    return result


def _measure(
    stack: StackSettings,
    workdir: Path,
    load: Load,
    console: Console,
    rounds: int,
    trajectory_rollouts: int,
) -> Measured:
    """Produce the load, then time each reader on it, the joiners last: the floor and one
    worker alternate for ``rounds`` rounds, the last worker kept up for the live rollouts."""
    with closing(redis.Redis.from_url(stack.redis_url)) as client:
        kafka.ensure_topics(stack)
        with Progress(console=console, transient=True) as progress:
            # Event time ends well before now, so the live rollouts' windows start fresh.
            base_ms = (
                int(time.time() * 1000) - load.spacing_ms * load.rollouts - 10 * load.close_after_ms
            )
            ids, load_bytes = produce_load(
                stack, load.rollouts, load.spacing_ms, base_ms, load.close_after_ms, progress
            )
            events = 3 * len(ids)
            with console.status("joiner in-process, then signing each reward"):
                inprocess = joiner_inprocess(load.rollouts, load.spacing_ms, base_ms)
                inprocess_signed = joiner_inprocess(
                    load.rollouts, load.spacing_ms, base_ms, checked=True
                )
                signatures = signature_costs()
            with console.status("agent trajectories of 4k and 32k tokens, in-process"):
                trajectories = join_trajectories.measure(trajectory_rollouts)
            raw = raw_consume(stack, events, progress)
            floors, earlier_ones = [], []
            for r in range(rounds):
                floors.append(faust_floor(stack, workdir, events, progress, r))
                if r < rounds - 1:
                    earlier_ones.append(
                        throughput_round(stack, workdir, client, events, r, progress)
                    )
                    empty_reward_topics(stack)
            one, opened = one_worker_and_live(
                stack, workdir, client, events, load.live_rollouts, load.live_rate_per_s, progress
            )
            empty_reward_topics(stack)
            two = two_workers(stack, workdir, client, events + 3 * load.live_rollouts, progress)
    return Measured(
        ids=ids + list(opened),
        main_ids={i for i in ids if not i.startswith(SENTINEL)},
        load_bytes=load_bytes,
        events=events,
        inprocess=inprocess,
        inprocess_signed=inprocess_signed,
        signatures=signatures,
        raw=raw,
        floors=floors,
        earlier_ones=earlier_ones,
        one=one,
        two=two,
        latencies=settle_latencies(one.rewards, opened, load.close_after_ms),
        trajectories=trajectories,
    )


def _exact_rounds(m: Measured) -> tuple[Exactness, ...]:
    """Each one-worker round's rewards against the rollouts it read (the last round's
    worker also read the live ones)."""
    main_load = [i for i in m.ids if i in m.main_ids or i.startswith(SENTINEL)]
    earlier = (exactness(r.rewards, main_load) for r in m.earlier_ones)
    return (*earlier, exactness(m.one.rewards, m.ids))


def _result(m: Measured, load: Load, join_settings: RewardStreamSettings, code: str) -> JoinResult:
    settle_one, settle_two = (
        rewards_span(m.one.rewards, m.main_ids),
        rewards_span(m.two.rewards, m.main_ids),
    )
    one_rates = [r.read.events_per_s for r in (*m.earlier_ones, m.one)]
    floor_rates = [f.events_per_s for f in m.floors]
    one_rate, two_rate, floor_rate = max(one_rates), m.two.read.events_per_s, max(floor_rates)
    reward, rollout = m.signatures["reward"], m.signatures["rollout"]
    return JoinResult(
        code=code,
        rollouts=load.rollouts,
        events=m.events,
        mean_event_bytes=round(m.load_bytes / (3 * load.rollouts)),
        partitions=PARTITIONS,
        spacing_ms=load.spacing_ms,
        window_s=join_settings.window_s,
        grace_s=join_settings.grace_s,
        raw_consumer_events_per_s=round(m.raw.events_per_s),
        rounds=len(m.floors),
        faust_floor_events_per_s=round(floor_rate),
        faust_floor_rounds=tuple(round(rate) for rate in floor_rates),
        joiner_inprocess_events_per_s=round(m.inprocess.events_per_s),
        joiner_inprocess_signed_events_per_s=round(m.inprocess_signed.events_per_s),
        signed_vs_unsigned_inprocess=round(
            m.inprocess_signed.events_per_s / m.inprocess.events_per_s, 3
        ),
        sign_us_per_reward=reward.sign_us,
        verify_us_per_reward=reward.verify_us,
        reward_bytes=reward.bytes,
        sign_us_per_rollout=rollout.sign_us,
        verify_us_per_rollout=rollout.verify_us,
        rollout_bytes=rollout.bytes,
        events_per_s=round(one_rate),
        events_per_s_rounds=tuple(round(rate) for rate in one_rates),
        exact_1_worker_rounds=_exact_rounds(m),
        events_per_s_2_workers=round(two_rate),
        ratio_vs_floor=round(one_rate / floor_rate, 3),
        floor_vs_raw=round(floor_rate / m.raw.events_per_s, 3),
        scaleout_2_vs_1=round(two_rate / one_rate, 3),
        rate_source="worker clocks",
        settle_events_per_s=round(settle_one.events_per_s),
        settle_events_per_s_2_workers=round(settle_two.events_per_s),
        rewards_1_worker=len(m.one.rewards),
        rewards_2_workers=len(m.two.rewards),
        exact_1_worker=exactness(m.one.rewards, m.ids),
        exact_2_workers=exactness(m.two.rewards, m.ids),
        join_1_worker=m.one.counts,
        join_2_workers=m.two.counts,
        partitions_2_workers=m.two.partitions,
        live_rollouts=load.live_rollouts,
        live_rate_per_s=load.live_rate_per_s,
        latency_samples=len(m.latencies),
        p50_settle_latency_s=round(statistics.median(m.latencies), 4),
        p99_settle_latency_s=round(percentile(m.latencies, 0.99), 4),
        trajectories=m.trajectories,
    )


def _print(r: JoinResult, out: Path, console: Console) -> None:
    load = f"{r.events:,} events of ~{r.mean_event_bytes} B, {r.partitions} partitions"
    table = Table(title=f"bench join -> {out} ({load})", title_justify="left")
    for column in ("reader", "events/s", "vs faust floor", "vs raw consumer"):
        table.add_column(column, justify="right")
    floor, raw = r.faust_floor_events_per_s, r.raw_consumer_events_per_s
    for name, rate in (
        ("raw confluent-kafka consumer", raw),
        (f"bare faust agent (floor), best of {r.rounds}", floor),
        ("Joiner.feed_record in-process, aligned", r.joiner_inprocess_events_per_s),
        (
            "... checking every record's writer, authenticating every reward",
            r.joiner_inprocess_signed_events_per_s,
        ),
        (f"reward_stream, 1 worker, best of {r.rounds}", r.events_per_s),
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
        f"rounds: floor {', '.join(f'{x:,}' for x in r.faust_floor_rounds)}; 1 worker "
        f"{', '.join(f'{x:,}' for x in r.events_per_s_rounds)} events/s; every round exact: "
        f"{all(e == Exactness(0, 0) for e in r.exact_1_worker_rounds)}"
    )
    console.print(
        f"checks: {r.sign_us_per_reward} us to seal a {r.reward_bytes:,}-byte reward (the joiner: "
        f"a MAC per reader), {r.verify_us_per_reward} us to check it (the trainer: its MAC); "
        f"{r.sign_us_per_rollout} us to seal a {r.rollout_bytes:,}-byte rollout (a worker: "
        f"signature and the joiner's MAC), {r.verify_us_per_rollout} us to check it (the joiner: "
        f"its MAC); checked/unchecked in-process {r.signed_vs_unsigned_inprocess}"
    )
    _print_trajectories(r.trajectories, console)
    console.print(
        f"ratio_vs_floor {r.ratio_vs_floor:.2f} (target >= 0.6 with every check on), "
        f"scaleout_2_vs_1 {r.scaleout_2_vs_1:.2f} (target >= 1.6), "
        f"settle latency p50 {r.p50_settle_latency_s * 1000:.0f} ms, "
        f"p99 {r.p99_settle_latency_s * 1000:.0f} ms "
        f"over {r.latency_samples} live rollouts at {r.live_rate_per_s:g}/s"
    )


def _print_trajectories(loads: tuple[TrajectoryLoad, ...], console: Console) -> None:
    table = Table(
        title="agent trajectories, joined in-process as the service joins them",
        title_justify="left",
    )
    for column in (
        "load",
        "record B (whole)",
        "reward B",
        "events/s",
        "missing/doubled",
        "B per pending (whole)",
        "10-min window",
    ):
        table.add_column(column, justify="right")
    for t in loads:
        table.add_row(
            f"{t.tokens:,} tokens" if t.tokens else "single turn",
            f"{t.record_bytes:,} ({t.whole_record_bytes:,})",
            f"{t.reward_bytes:,}",
            f"{t.events_per_s:,}",
            f"{t.missing}/{t.doubled}",
            f"{t.pending_bytes:,} ({t.pending_bytes_inline:,})",
            f"{t.window_mb:,} MB",
        )
    console.print(table)
