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
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
import torch
from confluent_kafka import Consumer, Producer
from opentelemetry import metrics

from rtrl import bulk, otel, signing
from rtrl.checkpoint import Checkpoint
from rtrl.config import StackSettings
from rtrl.heartbeat import beat_forever
from rtrl.kafka import consumer_config, producer_config
from rtrl.policy import PolicyConfig
from rtrl.trainer import plugins
from rtrl.trainer.config import TrainerSettings
from rtrl.trainer.distributed import World
from rtrl.trainer.learner import ShardedLearner
from rtrl.trainer.loop import Trainer
from rtrl.trainer.metrics import StepExporter
from rtrl.trainer.publishing import CONTROL, TREATMENT, FetchWeights
from rtrl.v1 import weights_pb2

if TYPE_CHECKING:
    from rtrl.weight_sync.client import Publisher

log = logging.getLogger("trainer")


def fetch_published(
    addr: str,
    token: str,
    arm: str,
    version: int,
    public_keys: Sequence[str],
    tls_ca_file: Path | None = None,
) -> tuple[weights_pb2.Manifest, dict[str, torch.Tensor]]:
    """The manifest and weights weight_sync holds for one version of an arm, if the
    trainer signed it (a resume never starts from weights someone else wrote)."""
    from rtrl.weight_sync.client import Subscriber

    subscriber = Subscriber(
        addr,
        arm,
        worker_id="trainer-resume",
        token=token,
        public_keys=public_keys,
        tls_ca_file=tls_ca_file,
    )
    try:
        for manifest, weights in subscriber.follow(have_version=version - 1):
            if manifest.version >= version:
                return manifest, {name: tensor.clone() for name, tensor in weights.items()}
        raise RuntimeError(f"weight_sync stream of {arm} ended before v{version}")
    finally:
        subscriber.close()


def follow_rank_zero(settings: TrainerSettings, stack: StackSettings, world: World) -> None:
    """A rank other than 0 under torchrun: hold its shards and do what rank 0 says.

    It ignores SIGTERM and SIGINT (torchrun forwards them to every rank): rank 0 stops
    after the current step and then closes the group, which ends this loop. Runs in
    the main thread (signal handlers can only be set there).
    """
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    path = stack.model_dir or plugins.initial_policy(settings)(
        stack.state_dir, PolicyConfig(), settings.seed
    )
    policy = Checkpoint.open(path)
    model = policy.load_model(settings.dtype, settings.device)
    ref_model = policy.load_model(settings.dtype, settings.device)
    ref_model.requires_grad_(False)
    learner = ShardedLearner(model, ref_model, settings, world)
    log.info("rank %d of %d following rank 0", world.rank, world.world_size)
    learner.follow()


async def serve(
    settings: TrainerSettings, stack: StackSettings, world: World | None = None
) -> None:
    torch.set_num_threads(1)
    if world is not None and world.rank != 0:
        follow_rank_zero(settings, stack, world)
        return
    stop = threading.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    fetch_weights = own_versions(settings, stack)
    publishers = arm_publishers(settings, stack)
    # The trainer subscribes itself: it seeks to its journal's positions on assignment.
    rewards = Consumer(consumer_config(stack, settings.consumer_group))
    otel.configure("trainer", stack)
    exporter = StepExporter(
        Producer(producer_config(stack)),
        signing.Signer(
            settings.manifest_signing_key.get_secret_value(), signing.Purpose.TRAINER_STEP
        ),
    )
    trainer = Trainer(
        settings,
        stack.state_dir,
        rewards,
        publishers,
        fetch_weights=fetch_weights,
        model_dir=stack.model_dir,
        on_step=exporter,
        world=world,
        dead_letter=exporter.dead_letter,
        bulk_store=bulk.BulkStore(stack.resolved_rollout_bulk_dir()),
    )
    otel.observe_lag(
        metrics.get_meter("rtrl.trainer"), settings.consumer_group, trainer.intake.lag.readings
    )
    redis = aioredis.from_url(stack.redis_url)
    try:
        await _run(trainer, stop, redis, stack.instance)
    finally:
        rewards.close()
        exporter.flush()
        for publisher in publishers.values():
            publisher.close()
        await redis.aclose()


def own_versions(settings: TrainerSettings, stack: StackSettings) -> FetchWeights:
    """fetch_published for versions the trainer signed: with its own key, or with a key
    being rotated out."""
    token = stack.weight_sync_token.get_secret_value()
    own_keys = [
        signing.public_key_of(settings.manifest_signing_key.get_secret_value()),
        *signing.parse_public_keys(stack.manifest_public_keys),
    ]
    return lambda arm, version: fetch_published(
        stack.weight_sync_addr, token, arm, version, own_keys, stack.weight_sync_tls_ca_file
    )


def arm_publishers(settings: TrainerSettings, stack: StackSettings) -> dict[str, Publisher]:
    """A weight_sync publisher per arm, signing every version with the trainer's key."""
    from rtrl.weight_sync.client import Publisher

    return {
        arm: Publisher(
            stack.weight_sync_addr,
            stack.weight_sync_token.get_secret_value(),
            arm,
            settings.keyframe_every,
            signing_key=settings.manifest_signing_key.get_secret_value(),
            tls_ca_file=stack.weight_sync_tls_ca_file,
        )
        for arm in (CONTROL, TREATMENT)
    }


async def _run(
    trainer: Trainer, stop: threading.Event, redis: aioredis.Redis, instance: str
) -> None:
    """Start the trainer, beat once both arms have a version, run it until stop is set."""
    heartbeat: asyncio.Task | None = None
    try:
        await asyncio.to_thread(trainer.start)
        heartbeat = asyncio.create_task(beat_forever(redis, "trainer", instance, trainer.heartbeat))
        log.info("trainer up: treatment v%d, step %d", trainer.version, trainer.step)
        await asyncio.to_thread(trainer.run, stop)
        log.info("trainer stopped at step %d, treatment v%d", trainer.step, trainer.version)
        if trainer.world is not None:
            trainer.learner.close()
    finally:
        if heartbeat is not None:
            heartbeat.cancel()
