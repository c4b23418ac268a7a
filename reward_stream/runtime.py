"""Between Kafka records and the pure join: decoding, per-partition state, counters.

No faust here, so the whole record-in/records-out path is testable without a
broker; app.py only moves these records to and from faust.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

from reward_stream import join, reward
from reward_stream.codec import MalformedEvent, PrivacyModeEvent, decode
from rtrl import topics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OutRecord:
    """A record to publish. Produced by Joiner; consumed by app.py's publisher."""

    topic: str
    key: bytes
    value: bytes
    headers: tuple[tuple[str, bytes], ...] = ()


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


class Joiner:
    """Join state for every partition this worker reads, keyed by partition number.

    The topics are co-partitioned by rollout_id, so partition p of every input topic
    feeds the same JoinState and stream time is tracked per partition.
    """

    def __init__(self, config: join.JoinConfig) -> None:
        self.config = config
        self.states: dict[int, join.JoinState] = {}
        self.counters = Counters()

    def feed(
        self, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None, now_ms: int
    ) -> list[OutRecord]:
        self.counters.events += 1
        try:
            event = decode(topic, key, value)
        except MalformedEvent as exc:
            self.counters.dlq += 1
            headers = (
                ("error", str(exc).encode()),
                ("source_topic", topic.encode()),
                ("source_partition", str(partition).encode()),
                ("source_offset", str(offset).encode()),
            )
            return [OutRecord(topics.REWARD_DLQ, key or b"", value or b"", headers)]
        except PrivacyModeEvent:
            self.counters.privacy_dropped += 1
            return []
        state = self.states.get(partition) or join.JoinState(self.config)
        self.states[partition], outputs = join.step(state, event, now_ms)
        return self._records(outputs)

    def tick(self, now_ms: int) -> list[OutRecord]:
        records: list[OutRecord] = []
        for partition, state in list(self.states.items()):
            self.states[partition], outputs = join.tick(state, now_ms)
            records.extend(self._records(outputs))
        return records

    def pending(self) -> int:
        return sum(len(state.pending) for state in self.states.values())

    def status(self) -> dict:
        return {**asdict(self.counters), "pending": self.pending(), "partitions": sorted(self.states)}

    def _records(self, outputs: list[join.Output]) -> list[OutRecord]:
        records = []
        for output in outputs:
            if isinstance(output, join.Settled):
                record = reward.reward_record(
                    output.rollout.message, [e.message for e in output.events], output.settled_ts_ms
                )
                self.counters.settled += 1
                self.counters.defaulted += record.defaulted
                records.append(OutRecord(topics.REWARD, output.rollout_id.encode(), record.SerializeToString()))
            elif isinstance(output, join.Late):
                self.counters.late += 1
                event = output.event
                source = topics.ROLLOUT if event.kind == "rollout" else topics.BY_PAYLOAD[event.kind]
                headers = (("source_topic", source.encode()), ("kind", event.kind.encode()))
                records.append(
                    OutRecord(topics.REWARD_LATE, event.rollout_id.encode(), event.message.SerializeToString(), headers)
                )
            elif isinstance(output, join.Duplicate):
                self.counters.duplicates += 1
            elif isinstance(output, join.Dropped):
                self.counters.dropped += 1
                log.debug("dropped rollout %s: no RolloutRecord within max_wait", output.rollout_id)
        return records
