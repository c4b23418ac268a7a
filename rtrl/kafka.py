"""Kafka helpers shared by the services: topic creation, producers, consumers, lag.

Producers are librdkafka's idempotent producer (confluent-kafka): aiokafka's
InitProducerId v0 is refused by Tansu, librdkafka's is accepted. Every producer is
keyed by rollout_id. Consumers never auto-commit: each service commits offsets
only after the outputs they produced are durable.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from rtrl import topics
from rtrl.config import StackSettings

log = logging.getLogger("rtrl.kafka")


def ensure_topics(
    settings: StackSettings, names: tuple[str, ...] = topics.ALL, timeout_s: float = 20.0
) -> None:
    """Create the topics with the configured partition count and replication factor
    (retention is the broker's default); existing ones are kept.

    Refuses to run against existing topics whose partition count differs, since the
    joiner relies on every topic being co-partitioned by rollout_id.
    """
    admin = AdminClient(client_config(settings))
    existing = admin.list_topics(timeout=timeout_s).topics
    wrong = {
        n: len(existing[n].partitions)
        for n in names
        if n in existing and len(existing[n].partitions) != settings.kafka_partitions
    }
    if wrong:
        raise RuntimeError(
            f"topics exist with partition counts {wrong}, expected {settings.kafka_partitions} for all"
        )
    missing = [
        NewTopic(
            n,
            num_partitions=settings.kafka_partitions,
            replication_factor=settings.kafka_replication_factor,
        )
        for n in names
        if n not in existing
    ]
    for name, future in admin.create_topics(missing).items() if missing else ():
        try:
            future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"the broker at {settings.kafka_bootstrap} did not create topic {name} "
                f"in {timeout_s:.0f} s"
            ) from None
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise


def wait_for_broker(settings: StackSettings, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    admin = AdminClient(client_config(settings))
    while True:
        try:
            admin.list_topics(timeout=2)
            return
        except KafkaException as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"Kafka broker at {settings.kafka_bootstrap} not reachable: {exc}"
                ) from exc
            time.sleep(0.3)


def client_config(settings: StackSettings, **overrides) -> dict:
    """What every librdkafka client of the stack starts from: the brokers and how to reach
    them (SASL and TLS when the settings say so). Every producer, consumer and admin client
    is built on it, so none connects without the process's credentials."""
    config: dict = {
        "bootstrap.servers": settings.kafka_bootstrap,
        "security.protocol": settings.kafka_security_protocol.lower(),
    }
    if settings.kafka_security_protocol.startswith("SASL_"):
        config |= {
            "sasl.mechanism": settings.kafka_sasl_mechanism,
            "sasl.username": settings.kafka_sasl_username,
            "sasl.password": settings.kafka_sasl_password.get_secret_value(),
        }
    if settings.kafka_security_protocol.endswith("SSL") and settings.kafka_ssl_ca_file:
        config["ssl.ca.location"] = settings.kafka_ssl_ca_file
    config.update(overrides)
    return config


def faust_credentials(settings: StackSettings):
    """The same for faust (aiokafka): None for PLAINTEXT."""
    import ssl

    from faust.auth import SASLCredentials, SSLCredentials

    protocol = settings.kafka_security_protocol
    context = (
        ssl.create_default_context(cafile=settings.kafka_ssl_ca_file or None)
        if protocol.endswith("SSL")
        else None
    )
    if protocol.startswith("SASL_"):
        return SASLCredentials(
            username=settings.kafka_sasl_username, password=settings.kafka_sasl_password.get_secret_value(),
            mechanism=settings.kafka_sasl_mechanism, ssl_context=context,
        )  # fmt: skip
    return SSLCredentials(context) if context is not None else None


# A reward record carries its rollout's bytes (reward_stream.reward_wire.encode_with_rollout) plus
# its own fields: a rollout is recorded only if this much room is left for them under the
# stack's kafka_max_record_bytes, so the reward built on it can be written too.
REWARD_ROOM_BYTES = 64 * 1024


def max_rollout_bytes(max_record_bytes: int) -> int:
    """The largest rollout record a worker writes, for records of at most ``max_record_bytes``."""
    return max_record_bytes - REWARD_ROOM_BYTES


def producer_config(settings: StackSettings, **overrides) -> dict:
    return client_config(
        settings,
        **{
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 5,
            "partitioner": "murmur2_random",  # the Java client's partitioner, so every client agrees
            "message.max.bytes": settings.kafka_max_record_bytes,
            **overrides,
        },
    )


def consumer_config(settings: StackSettings, group_id: str, **overrides) -> dict:
    return client_config(
        settings,
        **{
            "group.id": group_id,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "session.timeout.ms": settings.kafka_session_timeout_ms,
            "heartbeat.interval.ms": max(settings.kafka_session_timeout_ms // 3, 500),
            "isolation.level": "read_committed",
            **overrides,
        },
    )


def consumer(settings: StackSettings, *topic_names: str, group_id: str, **overrides) -> Consumer:
    c = Consumer(consumer_config(settings, group_id, **overrides))
    c.subscribe(list(topic_names))
    return c


class AsyncProducer:
    """An idempotent producer whose sends are awaitable: the future resolves when the
    broker has acknowledged the record (or fails with the delivery error)."""

    def __init__(self, settings: StackSettings, **overrides) -> None:
        self._producer = Producer(producer_config(settings, **overrides))
        self._running = True
        self._poller = threading.Thread(target=self._poll, name="kafka-producer-poll", daemon=True)
        self._poller.start()

    def _poll(self) -> None:
        # A delivery callback that raises (say, its event loop already closed) must not
        # end this thread: every later send's future would then wait forever.
        while self._running:
            try:
                self._producer.poll(0.05)
            except Exception:
                log.exception("a Kafka delivery callback failed")

    def send(
        self, topic: str, value: bytes, key: str, headers: list[tuple[str, bytes]] | None = None
    ) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def on_delivery(err, msg) -> None:
            if err is not None:
                loop.call_soon_threadsafe(_set_exception, future, KafkaException(err))
            else:
                loop.call_soon_threadsafe(_set_result, future, (msg.partition(), msg.offset()))

        self._producer.produce(
            topic, value, key=key.encode(), headers=kafka_headers(headers), on_delivery=on_delivery
        )
        return future

    def send_batch(
        self, records: list[tuple[str, bytes, str, list[tuple[str, bytes]]]]
    ) -> asyncio.Future:
        """Produce (topic, value, key, headers) records in order; the future resolves once
        every one is acknowledged or failed, to a list of per-record errors (None for
        acknowledged). One wake-up of the event loop per batch, not per record."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        errors: list[BaseException | None] = [None] * len(records)
        left = [len(records)]
        lock = threading.Lock()

        def settle() -> None:
            # Called from the poll thread (deliveries) and this one (a full local queue).
            with lock:
                left[0] -= 1
                done = left[0] == 0
            if done:
                loop.call_soon_threadsafe(_set_result, future, errors)

        for index, (topic, value, key, headers) in enumerate(records):

            def on_delivery(err, msg, index=index) -> None:
                if err is not None:
                    errors[index] = KafkaException(err)
                settle()

            try:
                self._producer.produce(
                    topic,
                    value,
                    key=key.encode(),
                    headers=kafka_headers(headers),
                    on_delivery=on_delivery,
                )
            except (
                BufferError
            ) as exc:  # librdkafka's local queue is full: this one and the rest fail
                for rest in range(index, len(records)):
                    errors[rest] = exc
                    settle()
                break
        if not records:
            future.set_result(errors)
        return future

    def pending(self) -> int:
        return len(self._producer)

    def close(self, timeout_s: float = 10.0) -> int:
        """Flush and stop; returns how many records were still undelivered."""
        remaining = self._producer.flush(timeout_s)
        self._running = False
        self._poller.join(timeout=1)
        self._producer.close()  # drop broker connections now, not at garbage collection
        return remaining


def _set_result(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


@dataclass(frozen=True)
class PartitionLag:
    group: str
    topic: str
    partition: int
    committed: int  # -1 when the group has committed nothing yet
    end: int

    @property
    def lag(self) -> int:
        return self.end - max(self.committed, 0)


def consumer_lag(
    settings: StackSettings,
    group: str,
    topic_names: tuple[str, ...],
    timeout_s: float = 5.0,
    ends: dict[tuple[str, int], int] | None = None,
) -> list[PartitionLag]:
    """Committed offset vs log end for every partition a group reads.

    ``ends`` (from end_offsets) lets a caller asking about several groups probe each
    partition's end once."""
    c = Consumer(consumer_config(settings, group))
    try:
        tps = partitions(settings, topic_names, timeout_s)
        committed = c.committed(tps, timeout=timeout_s) if tps else []
        if ends is None:
            ends = end_offsets(settings, tps, timeout_s)
        return [
            PartitionLag(
                group,
                tp.topic,
                tp.partition,
                tp.offset if tp.offset >= 0 else -1,
                ends[(tp.topic, tp.partition)],
            )
            for tp in committed
        ]
    finally:
        c.close()


def cluster_id(settings: StackSettings, timeout_s: float = 10.0) -> str:
    """The broker cluster's id. A memory-only broker started anew has a new one, so
    offsets remembered from another cluster id must not be applied to it."""
    return AdminClient(client_config(settings)).list_topics(timeout=timeout_s).cluster_id or ""


def partitions(
    settings: StackSettings, topic_names: tuple[str, ...], timeout_s: float = 5.0
) -> list[TopicPartition]:
    """Every partition of the named topics that exist, from the broker's metadata."""
    metadata = AdminClient(client_config(settings)).list_topics(timeout=timeout_s).topics
    return [
        TopicPartition(t, p) for t in topic_names if t in metadata for p in metadata[t].partitions
    ]


PROBE_FETCH = {"fetch.wait.max.ms": 10}
"""For consumers that read to a partition's end and stop (end offsets, read-backs): a fetch
at the end returns after 10 ms instead of the default 500, so reaching EOF costs a round
trip, not half a second per fetch (the joiner reads back every partition it is assigned
before joining its first record; under traffic, at 500 ms, that stalled it ~3 s a partition)."""


def end_offsets(
    settings: StackSettings, tps: list[TopicPartition], timeout_s: float = 5.0
) -> dict[tuple[str, int], int]:
    """The offset after each partition's last record.

    Tansu answers ListOffsets(latest) with the base offset of the last record batch
    plus one, which undercounts when that batch holds several records (thousands, from
    a fast producer). So read from high-1 to the partition's EOF and take the last
    record's offset + 1 (exact on Apache Kafka too).
    """
    probe = Consumer(
        client_config(
            settings,
            **{
                "group.id": "rtrl-end-offsets",
                "enable.auto.commit": False,
                "enable.partition.eof": True,
                **PROBE_FETCH,
            },
        )
    )
    try:
        ends: dict[tuple[str, int], int] = {}
        to_read: list[TopicPartition] = []
        for tp in tps:
            _, high = probe.get_watermark_offsets(tp, timeout=timeout_s, cached=False)
            ends[(tp.topic, tp.partition)] = high
            if high > 0:
                to_read.append(TopicPartition(tp.topic, tp.partition, high - 1))
        if not to_read:
            return ends
        probe.assign(to_read)
        waiting = {(tp.topic, tp.partition) for tp in to_read}
        deadline = time.monotonic() + timeout_s
        while waiting and time.monotonic() < deadline:
            for msg in probe.consume(5000, timeout=0.02):
                error = msg.error()
                if error is None:
                    topic, partition, offset = record_position(msg)
                    ends[(topic, partition)] = max(ends[(topic, partition)], offset + 1)
                elif error.code() == KafkaError._PARTITION_EOF:
                    topic, partition, _ = record_position(msg)
                    waiting.discard((topic, partition))
        return ends
    finally:
        probe.close()


def record_position(msg: Message) -> tuple[str, int, int]:
    """(topic, partition, offset) of a record, or a partition-EOF event, from consume().
    librdkafka sets all three on those; only other error events may lack them (hence the
    Optional in confluent_kafka's types)."""
    topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
    if topic is None or partition is None or offset is None:
        raise ValueError(f"consumed message without a position: {msg.error()}")
    return topic, partition, offset


def record_headers(msg: Message) -> tuple[tuple[str, bytes | None], ...]:
    """A consumed record's headers. consume() gives a list of (name, bytes or None);
    confluent_kafka's type for them is what produce() takes (a dict too, str values too)."""
    return tuple(cast("list[tuple[str, bytes | None]]", msg.headers() or []))


def kafka_headers(
    headers: Sequence[tuple[str, bytes]] | None,
) -> list[tuple[str, str | bytes | None]]:
    """Headers as confluent_kafka's produce() is typed to take them (its list is invariant,
    so a list[tuple[str, bytes]] is refused although it is what it takes at run time)."""
    return list(headers or ())


UNSERVED_HEADER = "rtrl-unserved"
"""Set (to ``1``) by the ingest gateway on an event whose rollout no worker served: the
serving API marks each rollout it serves before answering it, so the gateway, which reads
those marks, knows. The joiner drops a rollout all of whose events say so once its window
closes, instead of holding it for the longest trajectory's wait (reward_stream/join.py).
Not authenticated: whoever can write to the broker can strip or add it, which only moves
a rollout between that rule and the joiner's bounded orphan shares, and a record of the
rollout, if one is read within its window, still settles it."""


def traceparent_headers(traceparent: str) -> list[tuple[str, bytes]]:
    return [("traceparent", traceparent.encode())] if traceparent else []
