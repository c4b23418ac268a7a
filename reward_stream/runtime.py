"""Between Kafka records and the pure join: decoding, per-partition state, counters,
and which input records may be acknowledged.

No faust here, so the whole record-in/records-out path is testable without a
broker; app.py only moves these records to and from faust.

Exactly-once without Kafka transactions. An input record is acknowledged (its
offset may be committed) only once every output it leads to is durable: a record
that joins a pending rollout stays unacknowledged until that rollout settles and
its reward is acked by the broker. The committed offset of each input partition is
therefore the low-water mark of the rollouts still pending there, and after a crash
they are read again and joined again, to the same reward (reward_id depends only on
the rollout and its events). Records read again whose rollout did settle must not
settle it twice: before the first record of a partition is joined, the partition's
settled memory is rebuilt from the reward and .late topics (restore()), so they
come out as duplicates.

Lag hints. The join's stream time follows the slowest source still behind (see
join.py), so every record is fed with whether it was the newest of its topic
partition when read: its offset against the larger of the partition's end when
this worker took it over (exact, from restore()) and the consumer's highwater
from its latest fetch (for what was produced since).
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from opentelemetry import trace

from rtrl import heartbeat, kafka, signing, spans, topics
from rtrl.reward_stream import join, monitors, reward, reward_wire
from rtrl.reward_stream.authn import Authenticator
from rtrl.reward_stream.codec import (
    MalformedEvent,
    PrivacyModeEvent,
    Unauthenticated,
    decode,
    message_of,
    rollout_of,
    telemetry_of,
)

log = logging.getLogger(__name__)
_settle_spans = spans.InstantSpans("rtrl.reward_stream")
"""Each reward's ``reward settle`` span: one per reward, on the hot path (rtrl/spans.py)."""
_ARMS = {1: "control", 2: "treatment"}
COMPONENTS = ("persisted_fraction", "dissatisfied", "tool_call_validity", "effort_penalty")

SOURCE_OF_TOPIC = {
    topics.ROLLOUT: join.SOURCE["rollout"],
    **{topic: join.SOURCE[kind] for kind, topic in topics.BY_PAYLOAD.items()},
}


@dataclass(slots=True)
class OutRecord:
    """A record to publish. Produced by Joiner; consumed by app.py's publisher."""

    topic: str
    key: bytes
    value: bytes
    headers: tuple[tuple[str, bytes], ...] = ()


@dataclass(slots=True)
class Batch:
    """What one input record or tick leads to. Produced by Joiner.feed_record/tick_batch;
    consumed by app.py, which publishes ``records``, waits for the broker, then acks ``acks``."""

    records: list[OutRecord]
    acks: list[object]
    """Handles of input records whose outputs are all in ``records`` (or that need none)."""


@dataclass
class Counters:
    """Totals since start, reported in the heartbeat."""

    events: int = 0
    duplicates: int = 0
    settled: int = 0
    defaulted: int = 0
    late: int = 0
    dlq: int = 0
    dropped: int = 0
    privacy_dropped: int = 0
    unauthenticated: int = 0
    """Records refused because their writer did not sign them (also counted in dlq)."""
    foreign: int = 0
    """Events left out of a reward because another client's key sent them (reward.from_its_client)."""
    orphans_dropped: int = 0
    """Rollouts dropped when their window closed without a record, every event of them
    stamped by the gateway as about a rollout no worker served (join.py)."""
    evicted: int = 0
    """Rollouts without a record evicted, oldest first, past their client's share of
    orphan bytes or the total (join.JoinConfig.orphan_bytes_per_client, orphan_bytes)."""
    first_event_ms: int = 0
    """Wall clock when the first record was read (0: none yet)."""
    last_event_ms: int = 0
    """Wall clock when the latest record was read: a worker whose input has records but
    whose last_event_ms stands still is stuck; benchmarks time reads with the pair."""


class Joiner:
    """Join state for every partition this worker reads, keyed by partition number.

    The topics are co-partitioned by rollout_id, so partition p of every input topic
    feeds the same JoinState and stream time is tracked per partition.
    """

    def __init__(
        self,
        config: join.JoinConfig,
        reward_fn_version: str = reward.REWARD_FN_VERSION,
        signer: signing.HeaderSigner | None = None,
        authenticator: Authenticator | None = None,
        late_signer: signing.HeaderSigner | None = None,
    ) -> None:
        self.config = config
        self.signer = signer
        """Signs every reward it writes (the service always has one; rtrl/signing.py)."""
        self.late_signer = late_signer
        """Signs every late record it writes, with the joiner's key for a purpose of its own:
        a late record holds a rollout's or an event's bytes, never to pass for a reward
        (the service always has one; the analytics sink stores only what verifies)."""
        self.authenticator = authenticator
        """Checks every record's writer before it is decoded (the service always has one):
        a reward is only ever built on a rollout a worker served and events the gateway
        admitted."""
        self.settled: Counter[tuple[str, bool]] = Counter()
        """Rewards settled per (arm, defaulted), and below their sum and their components'
        sums per (arm, component): plain sums on the hot path, read as metrics (app.py)."""
        self.reward_sums: defaultdict[tuple[str, bool], float] = defaultdict(float)
        self.component_sums: defaultdict[tuple[str, str], float] = defaultdict(float)
        self.behaviour_sums: Counter[tuple[str, str]] = Counter()
        """(arm, monitors.AGENT_COUNTS name) -> its sum over the rewards settled."""
        self.alert_counts: Counter[tuple[str, str]] = Counter()
        """(metric, kind) -> reward-hacking alerts raised."""
        self.reward_fn_version = reward_fn_version
        self.states: dict[int, join.JoinState] = {}
        self.start_ends: dict[tuple[str, int], int] = {}
        """(topic, partition) -> the offset after its last record when this worker took it over."""
        self.counters = Counters()
        self.monitor = monitors.MonitorState()
        # The newest reward-hacking alerts, shown in the heartbeat (and so in rtrl status).
        self.alerts: deque[monitors.Alert] = deque(maxlen=20)

    def feed(
        self,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | None,
        value: bytes | None,
        now_ms: int,
    ) -> list[OutRecord]:
        return self.feed_record(topic, partition, offset, key, value, now_ms).records

    def tick(self, now_ms: int) -> list[OutRecord]:
        return self.tick_batch(now_ms).records

    def restored(self, partition: int) -> bool:
        return partition in self.states

    def restore(
        self,
        partition: int,
        settled: dict[str, frozenset[str]],
        now_ms: int,
        positions: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        """Start partition's state with the rollouts already settled (rollout_id -> event_ids
        in their reward or .late records), remembered for settled_ttl_ms from now.

        ``positions`` maps each input topic to (where this worker starts reading it, its
        end offset) for that partition; topics with records in between start behind."""
        behind = set()
        for topic, (start, end) in (positions or {}).items():
            self.start_ends[(topic, partition)] = end
            if start < end:
                behind.add(SOURCE_OF_TOPIC[topic])
        state = join.JoinState(self.config, behind=behind)
        expires = now_ms + self.config.settled_ttl_ms
        for rollout_id, event_ids in settled.items():
            state.settled[rollout_id] = join.SettledMark(expires, event_ids)
        self.states[partition] = state

    def forget(self, partitions: set[int]) -> None:
        """Drop the state of partitions this worker no longer owns: their unacknowledged
        records are read again by the new owner from the committed offsets."""
        for partition in partitions:
            self.states.pop(partition, None)
        self.start_ends = {
            tp: end for tp, end in self.start_ends.items() if tp[1] not in partitions
        }

    def feed_record(
        self,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | None,
        value: bytes | None,
        now_ms: int,
        handle: object = None,
        highwater: Callable[[], int | None] | None = None,
        headers: Sequence[tuple[str, bytes]] | None = None,
    ) -> Batch:
        """Join one input record. ``highwater`` returns the consumer's latest known end of
        the record's partition (None when unknown); it is only asked once the record is
        past the end known at takeover. Without it a record counts as the newest.
        ``headers`` are the record's Kafka headers (a rollout's signature)."""
        counters = self.counters
        counters.events += 1
        if not counters.first_event_ms:
            counters.first_event_ms = now_ms
        counters.last_event_ms = now_ms
        caught_up = offset + 1 >= self.start_ends.get((topic, partition), 0)
        if caught_up and highwater is not None:
            caught_up = offset + 1 >= (highwater() or 0)
        state = self.states.get(partition) or join.JoinState(self.config)
        try:
            self._authenticate(topic, value, headers)
            event = decode(topic, key, value, handle, caught_up)
        except (MalformedEvent, PrivacyModeEvent) as exc:
            source = SOURCE_OF_TOPIC.get(topic)
            outputs: list[join.Output] = []
            # A topic the join does not read (the authenticator refuses it) moves no source.
            if source is not None:
                self.states[partition], outputs = join.skip(state, source, caught_up, now_ms)
            batch = self._batch(outputs)
            if isinstance(exc, PrivacyModeEvent):
                self.counters.privacy_dropped += 1
            else:
                batch.records.append(
                    self._dead_letter(str(exc), topic, partition, offset, key, value)
                )
            if handle is not None:
                batch.acks.append(handle)
            return batch
        event.unserved = any(name == kafka.UNSERVED_HEADER for name, _ in headers or ())
        self.states[partition], outputs = join.step(state, event, now_ms)
        batch = self._batch(outputs)
        if outputs and isinstance(refused := outputs[0], join.Refused):
            # Its handle is acknowledged by _batch along with the dead letter.
            batch.records.insert(
                0, self._dead_letter(refused.reason, topic, partition, offset, key, value)
            )
        return batch

    def _authenticate(
        self, topic: str, value: bytes | None, headers: Sequence[tuple[str, bytes]] | None
    ) -> None:
        if self.authenticator is None:
            return
        problem = self.authenticator.problem(topic, value or b"", headers)
        if problem is not None:
            self.counters.unauthenticated += 1
            raise Unauthenticated(problem)

    def _dead_letter(
        self,
        reason: str,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | None,
        value: bytes | None,
    ) -> OutRecord:
        """The input record as read, for the .dlq topic, with why it cannot be joined."""
        self.counters.dlq += 1
        headers = (
            ("error", reason.encode()),
            ("source_topic", topic.encode()),
            ("source_partition", str(partition).encode()),
            ("source_offset", str(offset).encode()),
        )
        return OutRecord(topics.REWARD_DLQ, key or b"", value or b"", headers)

    def tick_batch(self, now_ms: int) -> Batch:
        records: list[OutRecord] = []
        acks: list[object] = []
        for partition, state in list(self.states.items()):
            self.states[partition], outputs = join.tick(state, now_ms)
            batch = self._batch(outputs)
            records.extend(batch.records)
            acks.extend(batch.acks)
        return Batch(records, acks)

    def pending(self) -> int:
        return sum(state.waiting for state in self.states.values())

    def status(self) -> heartbeat.RewardStreamBeat:
        """The join's part of the worker's beat (the consumer's part is reward_stream.app's)."""
        return heartbeat.RewardStreamBeat(
            **asdict(self.counters),
            pending=self.pending(),
            partitions=tuple(sorted(self.states)),
            alerts=tuple(self.alerts),
            reward_by_version=monitors.reward_by_version(self.monitor),
        )

    def _batch(self, outputs: list[join.Output]) -> Batch:
        records: list[OutRecord] = []
        acks: list[object] = []
        for output in outputs:
            if isinstance(output, join.Settled):
                acks.extend(e.handle for e in (output.rollout, *output.links, *output.events))
                rollout, telemetry = rollout_of(output.rollout), telemetry_of(output.events)
                links = [rollout_of(link) for link in output.links]
                record = reward.reward_record(
                    rollout,
                    telemetry,
                    output.settled_ts_ms,
                    self.reward_fn_version,
                    with_rollout=False,
                    links=links,
                )
                self.counters.settled += 1
                self.counters.defaulted += record.defaulted
                self.counters.foreign += len(telemetry) - len(
                    reward.from_its_client(rollout, telemetry)
                )
                self._watch(record, rollout)
                self._observe(record, rollout)
                rewards = [
                    (record, output.rollout),
                    *zip(reward.link_rewards(record, links), output.links, strict=True),
                ]
                for each, event in rewards:
                    assert event.raw is not None  # decode() keeps every rollout's bytes
                    value = reward_wire.encode_with_rollout(each, event.raw)
                    headers = tuple(kafka.traceparent_headers(each.traceparent))
                    if self.signer is not None:
                        headers += self.signer.headers(value)
                    key = output.rollout_id.encode()
                    records.append(OutRecord(topics.REWARD, key, value, headers))
            elif isinstance(output, join.Dropped):
                acks.extend(e.handle for e in output.events)
                self._count_dropped(output)
            elif isinstance(output, join.Late):
                acks.append(output.event.handle)
                self.counters.late += 1
                event = output.event
                source = (
                    topics.ROLLOUT if event.kind == "rollout" else topics.BY_PAYLOAD[event.kind]
                )
                headers = (("source_topic", source.encode()), ("kind", event.kind.encode()))
                value = message_of(event).SerializeToString()
                if self.late_signer is not None:
                    headers += self.late_signer.headers(value)
                records.append(
                    OutRecord(topics.REWARD_LATE, event.rollout_id.encode(), value, headers)
                )
            elif isinstance(output, join.Refused):
                acks.append(output.event.handle)
            else:
                acks.append(output.event.handle)
                self.counters.duplicates += 1
        return Batch(records, [handle for handle in acks if handle is not None])

    def _count_dropped(self, dropped: join.Dropped) -> None:
        """Count a dropped rollout by its reason. Its events are not dead-lettered: copying
        them to the .dlq topic would spend the broker what dropping them saves."""
        if dropped.reason == "unserved":
            self.counters.orphans_dropped += 1
        elif dropped.reason == "evicted":
            self.counters.evicted += 1
            log.info(
                "evicted rollout %s of client %r: %d events and no record, over its client's "
                "or the total orphan bytes",
                dropped.rollout_id,
                dropped.events[0].client_id if dropped.events else "",
                len(dropped.events),
            )
        else:
            self.counters.dropped += 1
            log.debug("dropped rollout %s: no RolloutRecord within max_wait", dropped.rollout_id)

    def _observe(self, record, rollout) -> None:
        """The reward's sums, and its ``reward settle`` span: a child of the rollout's
        serving span, the reward's place in the rollout's trace, which the training
        step links to. On the hot path: about 8 us with an SDK recording spans (rtrl/spans.py)."""
        arm = _ARMS.get(rollout.arm, "unspecified")
        self.settled[arm, record.defaulted] += 1
        self.reward_sums[arm, record.defaulted] += record.reward
        components = record.components
        for name in COMPONENTS:
            self.component_sums[arm, name] += getattr(components, name)
        for name, n in monitors.agent_counts(record, rollout).items():
            self.behaviour_sums[arm, name] += n
        record.traceparent = _settle_spans.record(
            "reward settle",
            rollout.traceparent,
            trace.SpanKind.PRODUCER,
            {
                "messaging.system": "kafka",
                "messaging.operation.type": "publish",
                "messaging.destination.name": topics.REWARD,
                "rtrl.rollout_id": record.rollout_id,
                "rtrl.reward": record.reward,
            },
        )

    def _watch(self, record, rollout) -> None:
        """Feed a settled reward to the hacking monitor; log and keep what it raises."""
        self.monitor, alerts = monitors.step(self.monitor, record, rollout)
        for alert in alerts:
            log.warning(
                "reward-hacking alert: %s moved %.3f -> %.3f from v%d to v%d (z %.1f), e.g. %s",
                alert.metric,
                alert.previous_value,
                alert.value,
                alert.previous_version,
                alert.version,
                alert.z_score,
                ", ".join(alert.examples),
            )
        self.alerts.extend(alerts)
        self.alert_counts.update((alert.metric, alert.kind) for alert in alerts)
