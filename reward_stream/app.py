"""The faust worker: feeds Kafka records to the Joiner and publishes what it returns.

One agent reads the four co-partitioned input topics, so every event about a
rollout reaches the same in-memory JoinState (per partition); a timer ticks the
join for wall-clock settlement on idle partitions; a task heartbeats to Redis.

Configuration for faust-streaming 0.15.3 on Tansu (and on Apache Kafka alike):
  * faust declares no topics (topic_allow_declare=False): __main__ creates them with
    rtrl.kafka.ensure_topics, which also guarantees equal partition counts;
  * no leader topic (topic_disable_leader=True) and no tables, so faust needs no
    internal topics at all;
  * broker_session_timeout = StackSettings.kafka_session_timeout_ms (6 s) instead of
    faust's 45 s default: a group forms in ~3 s on Tansu instead of ~23 s. aiokafka
    speaks only the classic consumer-group protocol, which is what Tansu needs.

Exactly once: the agent reads a noack stream and acknowledges a record only when
the Joiner says its outputs are durable (runtime.py explains the scheme, and
publisher.py how the outputs are sent and their inputs acknowledged), and then only
in offset order per partition (acks.py: faust alone would commit past a single
pending record), so
faust's gap-aware commit never moves past a rollout that is still pending. Before
the first record of a partition, its settled memory is read back from the output
topics (recovery.py). stream_wait_empty is off: a rebalance must not wait for
pending rollouts to settle, since their records are simply read again by the new owner.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterable, Set

import faust
import redis.asyncio as aioredis
from faust.types import TP
from opentelemetry import metrics
from opentelemetry.metrics import Meter

from rtrl import heartbeat, kafka, otel, topics
from rtrl.config import StackSettings
from rtrl.reward_stream import recovery
from rtrl.reward_stream.acks import OrderedAcks, Ticket
from rtrl.reward_stream.authn import Authenticator
from rtrl.reward_stream.config import RewardStreamSettings
from rtrl.reward_stream.monitors import ALERT_KEYS
from rtrl.reward_stream.publisher import OutputPublisher
from rtrl.reward_stream.runtime import Counters, Joiner

SERVICE = "reward_stream"
log = logging.getLogger("reward_stream")


def now_ms() -> int:
    return int(time.time() * 1000)


def faust_app(settings: RewardStreamSettings, stack: StackSettings, datadir: str) -> faust.App:
    """A faust App configured as the module docstring explains (shared with the bench's floor agent)."""
    session_timeout_s = stack.kafka_session_timeout_ms / 1000
    return faust.App(
        settings.app_id,
        broker="kafka://" + stack.kafka_bootstrap,
        broker_credentials=kafka.faust_credentials(stack),
        broker_session_timeout=session_timeout_s,
        broker_heartbeat_interval=max(session_timeout_s / 3, 0.5),
        broker_rebalance_timeout=max(session_timeout_s, 10.0),
        consumer_auto_offset_reset="earliest",
        key_serializer="raw",
        value_serializer="raw",
        topic_partitions=stack.kafka_partitions,
        topic_allow_declare=False,
        topic_disable_leader=True,
        stream_wait_empty=False,
        producer_acks=-1,
        datadir=str(stack.state_dir / datadir),
        web_port=settings.web_port,
        web_bind="127.0.0.1",
        web_host="127.0.0.1",
        autodiscover=False,
    )


def create_app(settings: RewardStreamSettings, stack: StackSettings) -> faust.App:
    app = faust_app(settings, stack, "reward_stream")
    ordered = OrderedAcks()
    worker = _Worker(
        _joiner(settings),
        ordered,
        OutputPublisher(stack, settings.max_in_flight, functools.partial(_release, ordered)),
        app.consumer.highwater,
    )
    _observe(worker.joiner, worker.publisher, settings.app_id, worker.lag)
    _add_join_agent(app, worker, settings, stack)
    _add_signal_handlers(app, worker, settings.tick_interval_s)

    @app.task
    async def heartbeat_task():
        client = aioredis.Redis.from_url(stack.redis_url)
        try:
            await heartbeat.beat_forever(
                client, SERVICE, stack.instance, lambda: worker.status(app.consumer.assignment())
            )
        finally:
            await client.aclose()

    return app


def _joiner(settings: RewardStreamSettings) -> Joiner:
    return Joiner(
        settings.join_config(),
        settings.settled_version(),
        settings.reward_seal(),
        Authenticator.of(settings),
        late_signer=settings.late_seal(),
    )


def _release(ordered: OrderedAcks, handle: object) -> None:
    # A record's handle in the Joiner is the Ticket ordered.read() gave it.
    if not isinstance(handle, Ticket):
        raise TypeError(f"the joiner released {handle!r}, not a Ticket")
    ordered.done(handle)


@dataclasses.dataclass(frozen=True)
class _Worker:
    """What one worker's agent, timer, signal handlers and heartbeat share."""

    joiner: Joiner
    ordered: OrderedAcks
    publisher: OutputPublisher
    highwater: Callable[[TP], int | None]
    """The consumer's high watermark of a topic partition (None before its first fetch)."""
    read: dict[TP, int] = dataclasses.field(default_factory=dict)
    """Offset of the newest record read, per topic partition (consumer lag)."""

    def lag(self) -> list[tuple[float, str, int]]:
        """Records behind the high watermark, topic and partition, per partition read."""
        return [
            (max(0, (self.highwater(tp) or 0) - offset - 1), tp.topic, tp.partition)
            for tp, offset in list(self.read.items())
        ]

    def status(self, assignment: Set[TP]) -> heartbeat.RewardStreamBeat:
        return dataclasses.replace(
            self.joiner.status(),
            assigned=len(assignment),
            in_flight=self.publisher.in_flight(),
            unacked=self.ordered.waiting(),
        )


def _add_join_agent(
    app: faust.App, worker: _Worker, settings: RewardStreamSettings, stack: StackSettings
) -> None:
    """The agent that feeds every input record to the Joiner, in offset order."""
    joiner, publisher = worker.joiner, worker.publisher

    @app.agent(app.topic(*topics.TELEMETRY), name="join")
    async def join_agent(stream):
        async for event in stream.noack().events():
            message = event.message
            worker.read[message.tp] = message.offset
            if not joiner.restored(message.partition):
                await _restore(joiner, stack, settings.app_id, message.partition)
            batch = joiner.feed_record(
                message.topic,
                message.partition,
                message.offset,
                message.key,
                message.value,
                now_ms(),
                worker.ordered.read(message.tp, event),
                functools.partial(worker.highwater, message.tp),
                message.headers,
            )
            publisher.publish(batch)
            if publisher.full():
                await publisher.wait_for_room()


async def _restore(joiner: Joiner, stack: StackSettings, group: str, partition: int) -> None:
    """Read a partition's settled memory back from the output topics (recovery.py)."""
    positions = await asyncio.to_thread(recovery.input_positions, stack, group, partition)
    settled = await asyncio.to_thread(recovery.settled_rollouts, stack, partition)
    joiner.restore(partition, settled, now_ms(), positions)


def _add_signal_handlers(app: faust.App, worker: _Worker, tick_interval_s: float) -> None:
    """The deadline tick, and what a shutdown and a revocation do to the worker's state."""
    joiner, publisher = worker.joiner, worker.publisher

    @app.timer(tick_interval_s, name="deadline_tick")
    async def deadline_tick():
        publisher.publish(joiner.tick_batch(now_ms()))
        # Delivery reports are only served by poll(): when the input goes quiet, this is
        # what still acknowledges the last records.
        publisher.poll()

    # The ignores: mode types a receiver as taking any positional arguments after the
    # sender; these take the ones their signal sends.
    @app.on_before_shutdown.connect  # type: ignore[arg-type]
    async def on_shutdown(app, **kwargs) -> None:
        # Outputs delivered now are acknowledged now: fewer records to read again next
        # time. In the loop's thread, where acknowledging is safe; bounded, since
        # whatever is left is simply read again.
        publisher.flush(5.0)

    @app.on_partitions_revoked.connect  # type: ignore[arg-type]
    async def on_revoked(app, revoked, **kwargs) -> None:
        joiner.forget({tp.partition for tp in revoked})
        worker.ordered.forget(set(revoked))


def _observe(
    joiner: Joiner,
    publisher: OutputPublisher,
    group: str,
    lag: Callable[[], Iterable[tuple[float, str, int]]],
) -> None:
    """The joiner's counters and the consumer's lag as OpenTelemetry (and so Prometheus) metrics."""
    meter = metrics.get_meter("rtrl.reward_stream")
    _observe_records(meter, joiner.counters)
    _observe_rewards(meter, joiner)
    otel.observe(
        meter,
        "rtrl.reward_stream.pending",
        "gauge",
        lambda: [(joiner.pending(), {})],
        unit="{rollout}",
        description="Rollouts waiting for their window to close",
    )
    otel.observe(
        meter,
        "rtrl.reward_stream.in_flight",
        "gauge",
        lambda: [(publisher.in_flight(), {})],
        unit="{record}",
        description="Outputs not yet acked by the broker",
    )
    otel.observe_lag(meter, group, lag)


_OUTCOMES = (
    "settled",
    "defaulted",
    "duplicates",
    "late",
    "dlq",
    "dropped",
    "privacy_dropped",
    "unauthenticated",
    "foreign",
    "orphans_dropped",
    "evicted",
)
"""The joiner's counters read as ``rtrl.reward_stream.outcomes``, one label value each."""


def _observe_records(meter: Meter, counters: Counters) -> None:
    """What became of the input records."""
    otel.observe(
        meter,
        "rtrl.reward_stream.records",
        "counter",
        lambda: [(counters.events, {})],
        unit="{record}",
        description="Input records read",
    )
    otel.observe(
        meter,
        "rtrl.reward_stream.outcomes",
        "counter",
        lambda: [(getattr(counters, name), {"outcome": name}) for name in _OUTCOMES],
        unit="{record}",
        description="Rollouts settled (defaulted: without a user signal) and records set aside, by outcome",
    )


def _observe_rewards(meter: Meter, joiner: Joiner) -> None:
    """The rewards settled, by arm: how many, their sum and each component's sum."""
    otel.observe(
        meter,
        "rtrl.reward.settled",
        "counter",
        lambda: [(n, {"arm": arm, "defaulted": d}) for (arm, d), n in list(joiner.settled.items())],
        unit="{reward}",
        description="Rewards settled, by arm and whether the window closed without a user signal",
    )
    otel.observe(
        meter,
        "rtrl.reward.accumulated",
        "gauge",
        lambda: [
            (v, {"arm": arm, "defaulted": d}) for (arm, d), v in list(joiner.reward_sums.items())
        ],
        description="Sum of the rewards settled (a reward can be negative), by arm and defaulted: "
        "over rtrl.reward.settled, the mean",
    )
    otel.observe(
        meter,
        "rtrl.reward.component",
        "counter",
        lambda: [
            (v, {"arm": arm, "component": c}) for (arm, c), v in list(joiner.component_sums.items())
        ],
        description="Sum of each reward component over the rewards settled, by arm: over rtrl.reward.settled, its mean",
    )
    otel.observe(
        meter,
        "rtrl.reward.behaviour",
        "counter",
        lambda: [
            (n, {"arm": arm, "behaviour": b}) for (arm, b), n in list(joiner.behaviour_sums.items())
        ],
        description="What the settled rollouts did, by arm (reward_stream.monitors.agent_counts): "
        "trajectories, turns, tool calls, broken calls, parallel turns, clarifying questions, "
        "edits, truncations; over behaviour=trajectories, a rate or a mean",
    )
    otel.observe(
        meter,
        "rtrl.reward.hacking_alerts",
        "counter",
        lambda: [
            (joiner.alert_counts.get(key, 0), {"metric": key[0], "kind": key[1]})
            for key in dict.fromkeys([*ALERT_KEYS, *list(joiner.alert_counts)])
        ],
        unit="{alert}",
        description="Reward-hacking alerts raised (reward_stream/monitors.py), by metric and kind",
    )


def run(settings: RewardStreamSettings, stack: StackSettings) -> None:
    """Run a worker until SIGTERM/SIGINT (faust's Worker installs the handlers)."""
    otel.configure(SERVICE, stack)
    run_worker(create_app(settings, stack), stack)


def run_worker(app: faust.App, stack: StackSettings) -> None:
    """Run ``app`` as a faust worker (shared with the bench's floor agent)."""
    app.finalize()
    app.worker_init()
    app.worker_init_post_autodiscover()
    # The process's logging is rtrl.entrypoint's (one format for every service), not faust's.
    worker = faust.Worker(app, quiet=True, workdir=str(stack.state_dir), override_logging=False)
    # The terminal spinner writes escape codes into log files and, to spin on every
    # record, lowers the root logger to DEBUG.
    worker.spinner = None
    worker.execute_from_commandline()
