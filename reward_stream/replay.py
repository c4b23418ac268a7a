"""Replay: recompute rewards over retained telemetry with another reward-function version.

    python -m rtrl.reward_stream.replay r2   (stack and RTRL_REWARD_* settings from the environment)

Reads every retained record of the input topics (telemetry.rollout.v1 and the
telemetry topics) by partition assignment from the beginning up to the log end seen
at start, re-joins them with the pure join and writes one RewardRecord per rollout
to rl.reward.replay.<version> (or only returns them).

It never touches the live stream: assignment joins no consumer group, nothing is
ever committed (the live joiner's offsets stay where they are), and the output
topic is not one the trainer reads.

Determinism. The live join sees records in arrival order and settles on wall-clock
deadlines; a replay must give the same rewards every time. So each partition's
events are sorted by (client_ts_ms, event_id) and fed with an event-time clock:
now_ms is the stream time, and a final tick past max_wait settles (or drops) what
is still pending. settled_ts_ms is therefore event time, and the same retained log
always yields the same records and reward_ids. A record whose event time lies outside
the join's event-time window around its Kafka timestamp (the producer's clock when it
was written: what the live joiner's wall clock read, give or take its lag) is skipped,
as the live joiner dead-letters it; on the event-time clock it would otherwise drag
stream time along. A replay may join events the live
join routed to .late (an event that arrived late in wall-clock terms but is inside
the window in event time), so its rewards can differ from the live ones by design.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from dataclasses import dataclass

from confluent_kafka import (
    OFFSET_BEGINNING,
    TIMESTAMP_NOT_AVAILABLE,
    Consumer,
    Producer,
    TopicPartition,
)

from rtrl import entrypoint, kafka, signing, topics
from rtrl.config import StackSettings
from rtrl.reward_stream import join, reward
from rtrl.reward_stream.authn import Authenticator
from rtrl.reward_stream.codec import (
    MalformedEvent,
    PrivacyModeEvent,
    decode,
    rollout_of,
    telemetry_of,
)
from rtrl.v1 import reward_pb2


@dataclass(frozen=True)
class RetainedRecord:
    """One input record as read back from Kafka. Produced by read_retained; consumed by rejoin."""

    topic: str
    partition: int
    key: bytes | None
    value: bytes | None
    timestamp_ms: int | None = None
    """The record's Kafka timestamp; None when unknown (then its event time is not bounded)."""
    headers: tuple[tuple[str, bytes | None], ...] = ()
    """The record's Kafka headers (a rollout's signature)."""


@dataclass(frozen=True)
class Replay:
    """What a replay produced. Returned by rejoin and replay."""

    version: str
    records: tuple[reward_pb2.RewardRecord, ...]
    """One per settled rollout, by partition and then settle order."""
    skipped: int
    """Input records that were malformed, out of the event-time window, or from privacy-mode
    users (the live join skips them too)."""
    dropped: int
    """Rollouts with telemetry but no RolloutRecord."""
    late: int
    """Events for a rollout that had already settled in event time."""
    unauthenticated: int = 0
    """Records skipped because their writer did not sign them: rollouts no inference worker
    signed, events the gateway did not authenticate (also counted in skipped)."""


def read_retained(
    settings: StackSettings,
    topic_names: tuple[str, ...] = topics.TELEMETRY,
    timeout_s: float = 60.0,
) -> list[RetainedRecord]:
    """Every record of the topics (by default the join's inputs), up to the log ends seen when called."""
    tps = kafka.partitions(settings, topic_names)
    ends = kafka.end_offsets(settings, tps)
    remaining = {tp for tp, end in ends.items() if end > 0}
    # The group id is required by librdkafka but unused: assign() joins no group, and
    # neither auto-commit nor commit() ever runs, so no group's offsets move.
    consumer = Consumer(
        kafka.consumer_config(settings, "rtrl-reward-replay", **{"enable.auto.offset.store": False})
    )
    consumer.assign([TopicPartition(t, p, OFFSET_BEGINNING) for t, p in remaining])
    records: list[RetainedRecord] = []
    deadline = time.monotonic() + timeout_s
    try:
        while remaining:
            if time.monotonic() > deadline:
                raise TimeoutError(f"replay could not read to the end of {sorted(remaining)}")
            for msg in consumer.consume(500, timeout=0.2):
                if msg.error() is not None:
                    raise RuntimeError(f"replay read failed: {msg.error()}")
                topic, partition, offset = kafka.record_position(msg)
                tp = (topic, partition)
                if offset < ends[tp]:
                    kind, timestamp_ms = msg.timestamp()
                    known = timestamp_ms if kind != TIMESTAMP_NOT_AVAILABLE else None
                    headers = kafka.record_headers(msg)
                    records.append(
                        RetainedRecord(topic, partition, msg.key(), msg.value(), known, headers)
                    )
                if offset + 1 >= ends[tp]:
                    remaining.discard(tp)
    finally:
        consumer.close()
    return records


def rejoin(
    retained: list[RetainedRecord],
    config: join.JoinConfig,
    version: str,
    authenticator: Authenticator | None = None,
) -> Replay:
    """The pure part: join retained records per partition on an event-time clock. With
    ``authenticator`` (the command always has one), a rollout no worker signed or an event
    the gateway did not authenticate is skipped as the live joiner dead-letters it."""
    if version not in reward.FUNCTIONS:
        raise KeyError(
            f"unknown reward function version {version!r}; known: {sorted(reward.FUNCTIONS)}"
        )
    admitted = _admit(retained, config, authenticator)
    records: list[reward_pb2.RewardRecord] = []
    dropped = late = 0
    for partition in sorted(admitted.by_partition):
        for output in _join_partition(admitted.by_partition[partition], config):
            if isinstance(output, join.Settled):
                rollout, telemetry = rollout_of(output.rollout), telemetry_of(output.events)
                links = [rollout_of(link) for link in output.links]
                record = reward.reward_record(
                    rollout, telemetry, output.settled_ts_ms, version, links=links
                )
                records.append(record)
                for each, link in zip(reward.link_rewards(record, links), links, strict=True):
                    each.rollout.CopyFrom(link)
                    records.append(each)
            dropped += isinstance(output, join.Dropped)
            late += isinstance(output, join.Late)
    return Replay(
        version, tuple(records), admitted.skipped, dropped, late, admitted.unauthenticated
    )


@dataclass(frozen=True)
class _Admitted:
    """The retained records a replay joins, decoded and by partition, and how many it
    skipped. Produced by _admit; consumed by rejoin."""

    by_partition: dict[int, list[join.Event]]
    skipped: int
    unauthenticated: int
    """Of the skipped, those their writer did not sign."""


def _admit(
    retained: list[RetainedRecord],
    config: join.JoinConfig,
    authenticator: Authenticator | None,
) -> _Admitted:
    """Decode each record the live joiner would join; skip the others (unsigned,
    malformed, privacy mode, outside the event-time window), in the order they were read."""
    by_partition: dict[int, list[join.Event]] = defaultdict(list)
    skipped = unauthenticated = 0
    for record in retained:
        if authenticator is not None and authenticator.problem(
            record.topic,
            record.value or b"",
            # Empty stands in for a header without a value: the verifier finds either unsigned.
            [(name, value or b"") for name, value in record.headers],
        ):
            skipped += 1
            unauthenticated += 1
            continue
        try:
            event = decode(record.topic, record.key, record.value)
        except (MalformedEvent, PrivacyModeEvent):
            skipped += 1
            continue
        if record.timestamp_ms is not None and not (
            record.timestamp_ms - config.max_age_ms
            <= event.client_ts_ms
            <= record.timestamp_ms + config.max_future_ms
        ):
            skipped += 1
            continue
        by_partition[record.partition].append(event)
    return _Admitted(by_partition, skipped, unauthenticated)


def _join_partition(events: list[join.Event], config: join.JoinConfig) -> list[join.Output]:
    """One partition's events joined in event-time order on an event-time clock, then
    settled past every deadline."""
    state = join.JoinState(config)
    outputs: list[join.Output] = []
    for event in sorted(events, key=lambda e: (e.client_ts_ms, e.event_id)):
        state, out = join.step(state, event, max(state.stream_time_ms, event.client_ts_ms))
        outputs.extend(out)
    # Past every deadline and max_wait: everything still pending settles or is dropped.
    state, out = join.tick(state, state.stream_time_ms + config.max_wait_ms + config.window_ms + 1)
    outputs.extend(out)
    return outputs


def publish(
    settings: StackSettings,
    result: Replay,
    timeout_s: float = 30.0,
    signer: signing.HeaderSigner | None = None,
) -> str:
    """Write the replayed records to their own topic, authenticated as the joiner
    authenticates its rewards (a trainer trains on nothing else); returns its name."""
    if signer is None:
        from rtrl.reward_stream.config import RewardStreamSettings

        signer = RewardStreamSettings().reward_seal()
    topic = topics.reward_replay(result.version)
    kafka.ensure_topics(settings, (topic,))
    producer = Producer(kafka.producer_config(settings))
    errors: list[str] = []

    def on_delivery(err, msg) -> None:
        if err is not None:
            errors.append(str(err))

    for record in result.records:
        value = record.SerializeToString()
        producer.produce(
            topic,
            value,
            key=record.rollout_id.encode(),
            headers=list(signer.headers(value)),
            on_delivery=on_delivery,
        )
    undelivered = producer.flush(timeout_s)
    producer.close()
    if undelivered or errors:
        raise RuntimeError(f"replay to {topic}: {undelivered} undelivered, errors {errors[:3]}")
    return topic


def replay(
    settings: StackSettings,
    config: join.JoinConfig,
    version: str,
    write: bool = True,
    authenticator: Authenticator | None = None,
) -> Replay:
    result = rejoin(read_retained(settings), config, version, authenticator)
    if write:
        publish(settings, result)
    return result


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1] not in reward.FUNCTIONS:
        print(
            f"usage: python -m rtrl.reward_stream.replay VERSION  (one of {sorted(reward.FUNCTIONS)})\n{__doc__}"
        )
        raise SystemExit(2)
    from rtrl.reward_stream.config import RewardStreamSettings

    # The version was read above; the settings and the keys a replay needs come as the joiner's do.
    settings, stack = entrypoint.parse_settings(
        "python -m rtrl.reward_stream.replay",
        __doc__,
        RewardStreamSettings,
        StackSettings,
        argv=[],
        required=RewardStreamSettings.required_secrets,
    )
    result = replay(
        stack, settings.join_config(), sys.argv[1], authenticator=Authenticator.of(settings)
    )
    print(
        f"{topics.reward_replay(result.version)}: {len(result.records)} rewards, "
        f"{result.skipped} skipped ({result.unauthenticated} records their writer did not sign), "
        f"{result.dropped} dropped, {result.late} late"
    )


if __name__ == "__main__":
    main()
