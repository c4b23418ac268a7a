"""When rewards arrive faster than the trainer trains (trainer/config.py, when_behind).

Two waves of reward records go to a real broker, the second produced after the first
was acknowledged: catch_up takes the oldest candidate's worth and leaves the rest in
Kafka for the next candidates; shed reads everything, keeps the newest candidate's
worth and counts the rest as shed, and its positions cover everything it read.
"""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Consumer

from rtrl import topics
from rtrl.kafka import consumer_config
from rtrl.trainer.batch import Drop, TrainSample, shed_oldest
from rtrl.trainer.config import TrainerSettings
from rtrl.trainer.intake import Intake
from rtrl.trainer.journal import position_key
from rtrl.trainer.loop import Trainer
from support.trainer import never_fetch, produce, reward_record

OLD, NEW = 100, 40
BATCH = 32


def _sample(rollout_id: str, reward_ts_ms: int) -> TrainSample:
    return TrainSample(
        rollout_id, "g", (1, 5), (6, 2), (-0.5, -0.1), 1.0, 1.0, 0, 0, reward_ts_ms=reward_ts_ms
    )


@pytest.mark.parametrize(
    "stamps, keep, kept, shed",
    [
        ([5, 1, 4, 2, 3], 3, [5, 4, 3], 2),  # the newest, in the order they were read
        ([1, 2], 3, [1, 2], 0),  # room for all: nothing shed
        ([7, 7, 7], 2, [7, 7], 1),  # ties: the later read are the newer
        ([], 4, [], 0),
    ],
)
def test_shed_oldest_keeps_the_newest_in_read_order(stamps, keep, kept, shed):
    samples = [_sample(f"r{i}", ts) for i, ts in enumerate(stamps)]
    out, n = shed_oldest(samples, keep)
    assert [s.reward_ts_ms for s in out] == kept and n == shed
    assert [s.rollout_id for s in out] == sorted(
        (s.rollout_id for s in out), key=lambda r: int(r[1:])
    )


def _trainer(stack_settings, when_behind: str) -> Trainer:
    settings = TrainerSettings(
        batch_size=BATCH, min_batch=BATCH, when_behind=when_behind, poll_timeout_s=0.5
    )
    consumer = Consumer(consumer_config(stack_settings, f"trainer-{when_behind}"))
    trainer = Trainer(
        settings, stack_settings.state_dir, consumer, publishers={}, fetch_weights=never_fetch
    )
    consumer.subscribe([topics.REWARD], on_assign=trainer.intake.on_assign)
    return trainer


def _poll_until(intake: Intake, read: int, timeout_s: float = 60) -> None:
    """Poll until `read` records were taken (pending or dropped)."""
    deadline = time.monotonic() + timeout_s
    while len(intake.pending) + sum(intake.drops.values()) < read:
        assert time.monotonic() < deadline, (
            f"read {len(intake.pending)} + {dict(intake.drops)} of {read}"
        )
        intake.poll()


@pytest.fixture
def two_waves(stack_settings):
    old = [reward_record("p", [1, 5], [6, 2], [-0.5, -0.1], 1.0) for _ in range(OLD)]
    produce(stack_settings.kafka_bootstrap, old)
    time.sleep(0.05)  # the second wave's broker timestamps are later
    new = [reward_record("p", [1, 5], [6, 2], [-0.5, -0.1], 1.0) for _ in range(NEW)]
    produce(stack_settings.kafka_bootstrap, new)
    return {r.rollout_id for r in old}, {r.rollout_id for r in new}


@pytest.mark.integration
def test_catch_up_takes_a_candidate_at_a_time_and_loses_nothing(stack_settings, two_waves):
    old, new = two_waves
    intake = _trainer(stack_settings, "catch_up").intake
    taken: list[str] = []
    try:
        while len(taken) < OLD + NEW:
            _poll_until(intake, 1)
            intake.poll()  # a full candidate reads nothing more; a partial one takes what has arrived
            assert len(intake.pending) <= BATCH
            assert sum(intake.positions.values()) == len(taken) + len(intake.pending), (
                "read past the candidate"
            )
            taken += [s.rollout_id for s in intake.pending]
            intake.pending = []  # trained, as train_pending would
    finally:
        intake.consumer.close()
    assert sorted(taken) == sorted(old | new) and not intake.drops


@pytest.mark.integration
def test_shed_reads_everything_and_keeps_the_newest_candidate(stack_settings, two_waves):
    old, new = two_waves
    trainer = _trainer(stack_settings, "shed")
    intake = trainer.intake
    try:
        _poll_until(intake, OLD + NEW)
    finally:
        intake.consumer.close()
    assert len(intake.pending) == BATCH
    assert {s.rollout_id for s in intake.pending} <= new, (
        "only the second wave's rewards are the newest"
    )
    assert intake.drops == {Drop.SHED: OLD + NEW - BATCH}
    # Everything read is consumed: the positions after the candidate are past every record.
    assert sum(intake.positions.values()) == OLD + NEW
    assert all(
        key == position_key(topics.REWARD, int(key.rsplit(":", 1)[1])) for key in intake.positions
    )
    trainer.reporter.refresh(len(intake.pending), intake.drops)  # as run() refreshes the beat
    assert trainer.heartbeat().dropped == {"shed": OLD + NEW - BATCH}
