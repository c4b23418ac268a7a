"""Acknowledging input records in offset order, per partition.

The joiner finishes records out of order: a record that joins a pending rollout
waits for it to settle while later records are done at once. faust turns acks into
commits by finding the first run of consecutive acked offsets, and only holds back
when the smallest acked offset is two or more past the committed one: with the
record at the committed offset still pending and the next one acked, it commits
past the pending record (faust-streaming 0.15.3, Consumer._new_offset). A rebalance
or a crash then skips that record, and its rollout's reward is lost. Acknowledging
each partition's records strictly in the order they were read means the acked
offsets always start at the committed one, whatever faust makes of a gap.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import Protocol


class Ackable(Protocol):
    def ack(self) -> object: ...


class Ticket:
    """One read record's place in its partition's queue. The Joiner carries it as the
    record's handle; ``OrderedAcks.done`` is called with it once its outputs are durable."""

    __slots__ = ("finished", "partition", "record")

    def __init__(self, partition: Hashable, record: Ackable) -> None:
        self.partition = partition
        self.record = record
        self.finished = False


class OrderedAcks:
    def __init__(self) -> None:
        self.queues: dict[Hashable, deque[Ticket]] = {}

    def read(self, partition: Hashable, record: Ackable) -> Ticket:
        """Register a record as it is read (records of a partition arrive in offset order)."""
        ticket = Ticket(partition, record)
        self.queues.setdefault(partition, deque()).append(ticket)
        return ticket

    def done(self, ticket: Ticket) -> None:
        """The record needs nothing more: acknowledge it and every finished record
        behind it, but nothing past a record that is still waiting."""
        ticket.finished = True
        queue = self.queues.get(ticket.partition)
        while queue and queue[0].finished:
            queue.popleft().record.ack()

    def waiting(self) -> int:
        return sum(len(queue) for queue in self.queues.values())

    def forget(self, partitions: set) -> None:
        """Partitions this worker no longer owns: their records are read again by the next owner."""
        for partition in partitions:
            self.queues.pop(partition, None)
