"""The consumer loop: every topic -> its writer checked -> rows -> batched inserts -> offset commit.

Offsets are committed only after the rows they produced are inserted, so a crash
replays at most the last batch; the ReplacingMergeTree tables collapse the replay.
A record whose writer does not verify (analytics/authn.py) is stored only as a dead
letter, with the reason, and its offset advances like any other's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

from confluent_kafka import Consumer, KafkaException, TopicPartition

from rtrl import otel
from rtrl.analytics.authn import Authenticator
from rtrl.analytics.rows import COLUMNS, KafkaRecord, convert_all, dead_letter
from rtrl.analytics.schema import DEAD_LETTERS
from rtrl.heartbeat import AnalyticsBeat
from rtrl.kafka import record_headers, record_position

log = logging.getLogger("rtrl.analytics.sink")


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class Sink:
    def __init__(
        self,
        consumer: Consumer,
        client,
        *,
        authenticator: Authenticator,
        batch_size: int,
        flush_interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        now_ms: Callable[[], int] = wall_clock_ms,
    ) -> None:
        self._consumer = consumer
        self._client = client
        self._authenticator = authenticator
        self._batch_size = batch_size
        self._flush_interval_s = flush_interval_s
        self._clock = clock
        self._now_ms = now_ms
        self._rows: dict[str, list[tuple]] = {table: [] for table in COLUMNS}
        self._next_offsets: dict[tuple[str, int], int] = {}
        self._pending = 0
        self._oldest_pending_at = 0.0
        self.consumed = 0
        self.inserted: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        """Records stored only as dead letters because their writer did not verify, per topic
        (every record of the dead-letter topic: nothing vouches for one)."""
        self.lag = otel.PositionLag()
        """The consumer's lag, refreshed between polls for the metrics scrape."""

    def status(self) -> AnalyticsBeat:
        return AnalyticsBeat(
            consumed=self.consumed,
            pending=self._pending,
            inserted={t: self.inserted[t] for t in COLUMNS},
        )

    def run(self, stopping: threading.Event, drain_s: float = 0.0) -> None:
        """Consume until ``stopping`` is set; then read on while records still come, for
        at most ``drain_s`` (what producers stopped before us wrote last), and insert and
        commit what is buffered."""
        poll_s = min(self._flush_interval_s, 0.5)
        while not stopping.is_set():
            self._consume(poll_s)
        drain_until = self._clock() + drain_s
        while self._clock() < drain_until and self._consume(poll_s):
            pass
        self.flush()

    def _consume(self, timeout_s: float) -> int:
        """One poll; returns the records it read."""
        messages = self._consumer.consume(self._batch_size, timeout=timeout_s)
        for msg in messages:
            error = msg.error()
            if error is not None:
                if error.fatal():
                    raise KafkaException(error)
                log.warning("consumer error (librdkafka retries it): %s", error)
                continue
            self.add(
                KafkaRecord(*record_position(msg), msg.key(), msg.value(), record_headers(msg))
            )
        self.lag.refresh(self._consumer, self._clock())
        if self._pending >= self._batch_size or (
            self._pending and self._clock() - self._oldest_pending_at >= self._flush_interval_s
        ):
            self.flush()
        return len(messages)

    def add(self, record: KafkaRecord) -> None:
        now_ms = self._now_ms()
        problem = self._authenticator.problem(record.topic, record.value, record.headers)
        if problem is None:
            rows = convert_all(record, now_ms)
        else:
            rows = [dead_letter(record, problem, now_ms)]
            self.refused[record.topic] += 1
        for row in rows:
            if row.table == DEAD_LETTERS:
                log.warning(
                    "dead letter %s[%d]@%d: %s",
                    record.topic,
                    record.partition,
                    record.offset,
                    row.values[4],
                )
            self._rows[row.table].append(row.values)
        if not self._pending:
            self._oldest_pending_at = self._clock()
        self._next_offsets[(record.topic, record.partition)] = record.offset + 1
        self._pending += 1
        self.consumed += 1

    def flush(self) -> None:
        """Insert every buffered row, then commit the offsets after them."""
        if not self._next_offsets:
            return
        for table, rows in self._rows.items():
            if rows:
                self._client.insert(table, rows, column_names=COLUMNS[table])
                self.inserted[table] += len(rows)
                rows.clear()
        offsets = [
            TopicPartition(topic, partition, offset)
            for (topic, partition), offset in self._next_offsets.items()
        ]
        self._consumer.commit(offsets=offsets, asynchronous=False)
        self._next_offsets.clear()
        self._pending = 0

    def on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # The next owner starts from our committed offsets: hand over a clean state.
        self.flush()
