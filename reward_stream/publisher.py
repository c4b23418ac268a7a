"""Publishing the joiner's outputs, acknowledging each input once its outputs are durable.

The outputs go through librdkafka (confluent-kafka), not faust's own aiokafka producer:
librdkafka's producer is idempotent on Tansu and on Apache Kafka alike (aiokafka's is
refused by Tansu), and it batches in its own threads, where aiokafka built one produce
request per reward in this event loop (about half of the worker's time on a backlog).

Delivery reports run on ``poll()``, which the worker calls from its event loop after
every record and on every tick, so the acknowledgements (faust is not thread-safe)
happen in the loop's thread. An output the broker refuses ends the process: its
inputs stay unacknowledged, and a worker that carried on would commit past them.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

from confluent_kafka import KafkaError, Message, Producer

from rtrl import kafka
from rtrl.config import StackSettings
from rtrl.reward_stream.runtime import Batch

log = logging.getLogger(__name__)

EXIT_OUTPUT_REFUSED = 70


class OutputPublisher:
    def __init__(
        self,
        stack: StackSettings,
        max_in_flight: int,
        release: Callable[[object], None],
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        self.producer = Producer(
            kafka.producer_config(
                stack, **{"linger.ms": 5, "queue.buffering.max.messages": 4 * max_in_flight}
            )
        )
        self.max_in_flight = max_in_flight
        self.release = release
        """Called with each input handle once its outputs are durable (OrderedAcks.done)."""
        self.on_refused = on_refused or _exit

    def publish(self, batch: Batch) -> None:
        """Hand the batch's outputs to the producer; its inputs are acknowledged once the
        broker holds all of them (at once if there are none)."""
        release = self.release
        if not batch.records:
            for handle in batch.acks:
                release(handle)
            return
        remaining = [len(batch.records)]
        acks = batch.acks

        def delivered(error: KafkaError | None, message: Message) -> None:
            if error is not None:
                self.on_refused(f"{message.topic()}: {error}")
                return
            remaining[0] -= 1
            if remaining[0] == 0:
                for handle in acks:
                    release(handle)

        for record in batch.records:
            self.producer.produce(
                record.topic,
                record.value,
                record.key,
                headers=list(record.headers),
                on_delivery=delivered,
            )
        self.producer.poll(0)

    def poll(self) -> None:
        """Run the delivery reports that have arrived."""
        self.producer.poll(0)

    def full(self) -> bool:
        return len(self.producer) >= self.max_in_flight

    async def wait_for_room(self) -> None:
        """Hold the caller while max_in_flight outputs await the broker's acknowledgement."""
        while self.full():
            await asyncio.sleep(0.002)
            self.producer.poll(0)

    def in_flight(self) -> int:
        return len(self.producer)

    def flush(self, timeout_s: float = 10.0) -> int:
        """Deliver what is queued (and acknowledge its inputs); returns what is left."""
        return self.producer.flush(timeout_s)


def _exit(reason: str) -> None:
    log.critical("the broker refused an output (%s); exiting so its inputs are read again", reason)
    os._exit(EXIT_OUTPUT_REFUSED)
