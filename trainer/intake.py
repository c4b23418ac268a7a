"""The trainer's intake: reward records read from Kafka become pending training samples.

Every record read is consumed (the position after it advances) whatever becomes of it:
its signature is checked against the joiner's keys (a record that fails is dead-lettered),
it is decoded, made a sample that fits the policy (trainer/batch.py says what is dropped
and why) and checked against the rollouts already trained on; what survives waits in
``pending`` until the loop takes it as a candidate. Every record not trained on is
counted by its Drop reason, never silently skipped.

Pending never exceeds one candidate (polls ask for at most the room left), so the
positions after a candidate are exact. Shedding (when_behind=shed) instead reads
everything there is and keeps the newest candidate's worth: a trainer slower than its
traffic trains on fresh rollouts, and the ones it sheds are counted. Nothing here trains,
judges or publishes; the loop commits the positions of what is final through commit().
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from confluent_kafka import KafkaError, KafkaException, TopicPartition
from google.protobuf.message import DecodeError

from rtrl import bulk, otel, signing
from rtrl.checkpoint import Checkpoint
from rtrl.trainer.batch import Drop, SeenRollouts, TrainSample, drop_stale, shed_oldest, to_sample
from rtrl.trainer.config import TrainerSettings
from rtrl.trainer.journal import Replayed, parse_position_key, position_key
from rtrl.v1 import reward_pb2, rollout_pb2

log = logging.getLogger("trainer")

# With nothing pending, commit the offsets of dropped records at most this often.
IDLE_COMMIT_S = 1.0
# when_behind=shed: most records one consume call asks for (the poll reads on to its deadline).
SHED_READ = 1024


# Produced by Intake.take; consumed by Trainer.train_pending.
@dataclass(frozen=True)
class Taken:
    """Everything pending, taken as the next candidate."""

    fresh: tuple[TrainSample, ...]
    """The samples to train on (the stale ones are counted and left out)."""
    staleness: tuple[int, ...]
    """Versions between the trainer and each pending sample's oldest token, stale ones included."""
    positions: dict[str, int]
    """Consumer positions right after the records taken."""
    waited_s: float
    """From the first of them being read to their being taken."""


class Intake:
    """Reads, verifies, decodes and deduplicates reward records into pending samples."""

    def __init__(
        self,
        settings: TrainerSettings,
        consumer,
        policy: Checkpoint,
        context_of: Callable[[rollout_pb2.RolloutRecord], str] | None,
        dead_letter: Callable[[object, str], None] | None = None,
        bulk_store: bulk.BulkStore | None = None,
    ) -> None:
        self.settings = settings
        self.bulk_store = bulk_store
        """Where a long rollout's bulk is read (rtrl/bulk.py); None: such rollouts are dropped."""
        # Refuses to build without a key: a trainer that cannot check rewards trains on none.
        self.verifier = signing.MacVerifier(
            signing.parse_mac_keys(settings.reward_mac_keys.get_secret_value()),
            signing.Purpose.REWARD,
        )
        self.consumer = consumer
        self.policy = policy
        """The policy a sample must fit (its positions and vocabulary); Trainer.start sets
        the one it loads."""
        self.context_of = context_of
        self.dead_letter = dead_letter
        """Where refused records go, with the reason (the reward DLQ); None: counted only."""
        self.pending: list[TrainSample] = []
        self.first_pending_at = 0.0
        self.seen = SeenRollouts(settings.dedup_capacity)
        self.drops: Counter[Drop] = Counter()
        self.positions: dict[str, int] = {}
        """Next offset to read per "topic:partition", everything before it consumed."""
        self.cluster_id = ""
        """The broker cluster self.positions are offsets in."""
        self.uncommitted = False
        self.last_commit_at = time.monotonic()
        self.lag = otel.PositionLag()
        """The consumer's lag, refreshed by the polling thread for the metrics scrape."""

    @property
    def capacity(self) -> int:
        """Most rollouts one candidate holds."""
        return self.settings.batch_size * self.settings.steps_per_candidate

    def identify_cluster(self) -> None:
        """Ask the broker which cluster it is: the journal's positions apply only to it."""
        self.cluster_id = self.consumer.list_topics(timeout=30).cluster_id or ""

    def resume(self, replayed: Replayed) -> None:
        """Read on from the journal's positions (unless they are another broker's), and
        refuse again the rollouts its final entries hold."""
        self.positions = dict(replayed.positions)
        if self.positions and replayed.cluster_id != self.cluster_id:
            log.warning(
                "the broker is new (cluster %r; the journal's positions are in %r): "
                "its topics start empty, so the journal's positions are not applied; "
                "whatever the old broker held and was not yet trained on is gone with it",
                self.cluster_id,
                replayed.cluster_id,
            )
            self.positions = {}
        for rollout_id in replayed.recent_ids:
            self.seen.admit(rollout_id)
        log.info(
            "resuming at %s with %d recent rollout ids",
            self.positions or "the committed offsets",
            len(replayed.recent_ids),
        )

    def subscribe(self) -> None:
        self.consumer.subscribe([self.settings.topic], on_assign=self.on_assign)

    def on_assign(self, consumer, partitions: list[TopicPartition]) -> None:
        """Seek each assigned partition to where the journal says to resume."""
        for partition in partitions:
            resume = self.positions.get(position_key(partition.topic, partition.partition))
            if resume is not None:
                partition.offset = resume
        consumer.assign(partitions)

    def poll(self) -> None:
        """Read up to the room left in the candidate: wait at most poll_timeout_s for the first
        records, then take whatever else the consumer already holds (most of a backlog's records
        can be the control arm's, dropped here: one read of `room` would leave the candidate
        half full while the rest waits for the next gate). Shedding (when_behind=shed), read
        everything there is until the deadline and keep the newest candidate's worth."""
        shedding = self.settings.when_behind == "shed"
        deadline = time.monotonic() + self.settings.poll_timeout_s
        timeout = self.settings.poll_timeout_s
        while (room := SHED_READ if shedding else self.capacity - len(self.pending)) > 0:
            messages = self.consumer.consume(num_messages=room, timeout=timeout)
            self._take(messages)
            if not messages or time.monotonic() >= deadline:
                break
            timeout = 0
        if shedding:
            # Everything read is consumed: what is shed is final, and the positions after the
            # next candidate still cover exactly what it holds or dropped.
            self.pending, shed = shed_oldest(self.pending, self.capacity)
            if shed:
                self.drops[Drop.SHED] += shed

    def refresh_lag(self, now: float) -> None:
        """On the polling thread, between polls (otel.PositionLag says why)."""
        self.lag.refresh(self.consumer, now)

    def _take(self, messages: list) -> None:
        read_ts_ms = int(time.time() * 1000)
        for message in messages:
            if message.error() is not None:
                raise KafkaException(message.error())
            self.uncommitted = True
            self.positions[position_key(message.topic(), message.partition())] = (
                message.offset() + 1
            )
            sample = self._sample(message)
            if isinstance(sample, Drop):
                self.drops[sample] += 1
                continue
            if not self.pending:
                self.first_pending_at = time.monotonic()
            self.pending.append(
                replace(sample, reward_ts_ms=max(message.timestamp()[1], 0), read_ts_ms=read_ts_ms)
            )

    def _sample(self, message) -> TrainSample | Drop:
        """The record's sample, or why it is not trained on (a record that is not the
        joiner's is dead-lettered too)."""
        problem = self.verifier.problem(message.value(), message.headers())
        if problem is not None:
            # Not the joiner's: never trained on, whatever it says.
            if self.dead_letter is not None:
                self.dead_letter(message, problem)
            return Drop.UNSIGNED if problem == signing.UNSIGNED else Drop.FORGED
        try:
            record = reward_pb2.RewardRecord.FromString(message.value())
        except DecodeError:
            return Drop.MALFORMED
        if record.rollout.HasField("bulk"):
            inflated = self._inflated(record.rollout)
            if isinstance(inflated, Drop):
                return inflated
            record.rollout.CopyFrom(inflated)
        sample = to_sample(
            record,
            self.policy.max_positions,
            self.context_of,
            vocab_size=self.policy.spec.vocab_size,
        )
        if isinstance(sample, TrainSample) and not self.seen.admit(sample.rollout_id):
            return Drop.DUPLICATE
        return sample

    def _inflated(self, rollout: rollout_pb2.RolloutRecord) -> rollout_pb2.RolloutRecord | Drop:
        """The rollout with its bulk read back from the store, or why not: gone from the
        store, or not the bulk the (verified) record names."""
        if self.bulk_store is None:
            return Drop.BULK_UNAVAILABLE
        try:
            return bulk.inflate(rollout, self.bulk_store)
        except bulk.BulkUnavailable as exc:
            log.warning("not trained on: %s", exc)
            return Drop.BULK_UNAVAILABLE
        except bulk.BulkCorrupt as exc:
            log.error("not trained on: %s", exc)
            return Drop.BULK_CORRUPT

    def due(self, now: float) -> bool:
        """Whether pending makes a candidate: a full batch, or min_batch waited on max_wait_s."""
        n = len(self.pending)
        return n >= self.settings.batch_size or (
            n >= self.settings.min_batch and now - self.first_pending_at >= self.settings.max_wait_s
        )

    def idle_commit_due(self, now: float) -> bool:
        """Nothing pending, and records consumed (all dropped) not committed for IDLE_COMMIT_S."""
        return not self.pending and self.uncommitted and now - self.last_commit_at >= IDLE_COMMIT_S

    def take(self, version: int, now: float) -> Taken:
        """Everything pending, as the next candidate of a trainer at this version: the samples
        more than max_staleness behind it are counted as stale and left out."""
        waited_s = now - self.first_pending_at
        staleness = tuple(version - sample.oldest_version for sample in self.pending)
        fresh, stale = drop_stale(self.pending, version, self.settings.max_staleness)
        self.pending = []
        if stale:
            self.drops[Drop.STALE] += stale
        return Taken(tuple(fresh), staleness, dict(self.positions), waited_s)

    def commit(self, positions: Mapping[str, int] | None = None) -> None:
        """Commit the offsets of what is final: these positions (records read past them may be
        pending or in a candidate not yet judged), or without them everything consumed."""
        if self.uncommitted:
            offsets = None
            if positions is not None:
                offsets = [
                    TopicPartition(*parse_position_key(key), offset)
                    for key, offset in positions.items()
                ]
            try:
                if offsets:
                    self.consumer.commit(offsets=offsets, asynchronous=False)
                elif positions is None:
                    self.consumer.commit(asynchronous=False)
            except KafkaException as exc:
                # Nothing consumed on any assigned partition since the last commit.
                if exc.args[0].code() != KafkaError._NO_OFFSET:
                    raise
            self.uncommitted = positions is not None and dict(positions) != self.positions
        self.last_commit_at = time.monotonic()
