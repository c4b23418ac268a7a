"""The trainer process: wires Kafka, weight_sync and Redis around the Trainer loop.

The loop runs in a worker thread (torch and the Kafka consumer block); the event
loop only beats the heartbeat and turns SIGTERM/SIGINT into a clean stop after the
current step: offsets of everything trained are committed (a pending partial batch
is left for the next run to read again) and a checkpoint is written.
The heartbeat starts once both arms have a version 0, so a healthy trainer means
the fleet has weights to load.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading

import redis.asyncio as aioredis
import torch
from confluent_kafka import Consumer, Producer

from rtrl.config import StackSettings
from rtrl.heartbeat import beat_forever
from rtrl import otel
from rtrl.kafka import consumer_config, producer_config
from rtrl.v1 import weights_pb2
from trainer.config import TrainerSettings
from trainer.loop import CONTROL, TREATMENT, Trainer
from trainer.metrics import StepExporter

log = logging.getLogger("trainer")


def fetch_published(addr: str, token: str, arm: str, version: int) -> tuple[weights_pb2.Manifest, dict[str, torch.Tensor]]:
    """The manifest and weights weight_sync holds for one version of an arm."""
    from weight_sync.client import Subscriber

    subscriber = Subscriber(addr, arm, worker_id="trainer-resume", token=token)
    try:
        for manifest, weights in subscriber.follow(have_version=version - 1):
            if manifest.version >= version:
                return manifest, {name: tensor.clone() for name, tensor in weights.items()}
        raise RuntimeError(f"weight_sync stream of {arm} ended before v{version}")
    finally:
        subscriber.close()


async def serve(settings: TrainerSettings, stack: StackSettings) -> None:
    from weight_sync.client import Publisher

    torch.set_num_threads(1)
    stop = threading.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    token = stack.weight_sync_token.get_secret_value()
    publishers = {arm: Publisher(stack.weight_sync_addr, token, arm, settings.keyframe_every) for arm in (CONTROL, TREATMENT)}
    # The trainer subscribes itself: it seeks to its journal's positions on assignment.
    rewards = Consumer(consumer_config(stack, settings.consumer_group))
    otel.configure("trainer", stack)
    exporter = StepExporter(Producer(producer_config(stack)))
    trainer = Trainer(
        settings,
        stack.state_dir,
        rewards,
        publishers,
        fetch_weights=lambda arm, version: fetch_published(
            stack.weight_sync_addr, stack.weight_sync_token.get_secret_value(), arm, version
        ),
        on_step=exporter,
    )
    redis = aioredis.from_url(stack.redis_url)
    heartbeat: asyncio.Task | None = None
    try:
        await asyncio.to_thread(trainer.start)
        heartbeat = asyncio.create_task(beat_forever(redis, "trainer", stack.instance, trainer.heartbeat))
        log.info("trainer up: treatment v%d, step %d", trainer.version, trainer.step)
        await asyncio.to_thread(trainer.run, stop)
        log.info("trainer stopped at step %d, treatment v%d", trainer.step, trainer.version)
    finally:
        if heartbeat is not None:
            heartbeat.cancel()
        rewards.close()
        exporter.flush()
        for publisher in publishers.values():
            publisher.close()
        await redis.aclose()
