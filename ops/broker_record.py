"""What the embedded stack's memory-only broker held when it went away.

Tansu keeps its topics in memory, so `rtrl down` (or a crash) loses whatever was on
them and not yet folded into something durable: telemetry the joiner had not turned
into rewards, rewards the trainer had not trained on. Everything else of a run
survives (statedir.py). The supervisor records each broker it starts in
``<state_dir>/broker.json`` with that count, measured every few seconds while it runs
and once more after the services stopped, so `rtrl status` on the next run can say
what the restart cost.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from rtrl import kafka, topics
from rtrl.config import StackSettings

FILENAME = "broker.json"


# Produced by the supervisor; consumed by `rtrl status` (status_view.py).
@dataclass(frozen=True)
class BrokerRecord:
    cluster_id: str
    bootstrap: str
    started_ts: float
    unjoined_events: int | None = None
    """Accepted telemetry events (edits, persistence, follow-ups) the joiner had not yet
    turned into a durable reward: its committed offsets' lag on those topics."""
    unjoined_rollouts: int | None = None
    """Rollout records the joiner had not yet settled."""
    untrained_rewards: int | None = None
    """Rewards on rl.reward.v1 the trainer had not consumed."""
    measured_ts: float | None = None
    final: bool = False
    """Measured after every service had stopped (otherwise: the last reading before a
    crash, so the loss was at least this)."""


# Produced and consumed as above: the broker of this run and the one before it.
@dataclass(frozen=True)
class BrokerHistory:
    current: BrokerRecord | None = None
    previous: BrokerRecord | None = None


def path(state_dir: Path) -> Path:
    return state_dir / FILENAME


def read(state_dir: Path) -> BrokerHistory:
    try:
        doc = json.loads(path(state_dir).read_text())
    except FileNotFoundError:
        return BrokerHistory()
    return BrokerHistory(**{k: BrokerRecord(**v) if v else None for k, v in doc.items()})


def write(state_dir: Path, history: BrokerHistory) -> None:
    tmp = path(state_dir).with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(history), indent=2))
    os.replace(tmp, path(state_dir))


def started(state_dir: Path, settings: StackSettings) -> BrokerHistory:
    """A new broker is up: the last one becomes the previous (its count is final now)."""
    history = BrokerHistory(
        current=BrokerRecord(kafka.cluster_id(settings), settings.kafka_bootstrap, time.time()),
        previous=read(state_dir).current,
    )
    write(state_dir, history)
    return history


def measure(
    settings: StackSettings,
    record: BrokerRecord,
    *,
    joiner_group: str,
    trainer_group: str,
    final: bool = False,
) -> BrokerRecord:
    """The record with what the broker holds that nothing durable has taken in yet."""
    joiner = kafka.consumer_lag(settings, joiner_group, topics.TELEMETRY)
    trainer = kafka.consumer_lag(settings, trainer_group, (topics.REWARD,))
    return replace(
        record,
        unjoined_events=sum(p.lag for p in joiner if p.topic != topics.ROLLOUT),
        unjoined_rollouts=sum(p.lag for p in joiner if p.topic == topics.ROLLOUT),
        untrained_rewards=sum(p.lag for p in trainer),
        measured_ts=time.time(),
        final=final,
    )
