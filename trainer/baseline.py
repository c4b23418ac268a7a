"""The baseline a rollout's reward is compared with, when no other rollout shares its prompt.

Leave-one-out (trainer/objective.py) needs rollouts of the same prompt in one batch. Real
traffic has unique prompts, so every rollout is alone in its group and falls back to the
batch mean: a rollout of an easy context looks good next to one of a hard context, and
the gradient rewards being asked easy things. ``RTRL_TRAINER_BASELINE=context`` compares
such a rollout with a running mean of the rewards earlier rollouts of its *context* got:
a key the product supplies (task type, repository, project). A product sends it as the
serving API's ``context_key``, which the record carries; a record without one (``""``)
is keyed by the ``RTRL_TRAINER_CONTEXT_KEY`` plug-in instead, which reads it from the
record some other way (the demo's parses the project tag of its prompts). Rollouts that
do share a prompt in the batch still use leave-one-out.

The running mean of a key is an exponential moving average over its last ``window``
rewards or so (a plain mean until it has that many), taken *before* the batch's rewards
are added, so a rollout's own reward is never in its baseline. A key with few rewards
leans on the mean over every context (PRIOR_REWARDS pseudo-rewards of it); a key never
seen gets that overall mean; before the very first reward, the batch fallback.

The means outlive the trainer: they are written beside its checkpoint (BASELINE_FILE),
whenever it is, and read back when the trainer resumes that checkpoint's lineage (a new
lineage starts them empty). After a crash they are the last checkpoint's: the rewards
since are missing until trained again, and a candidate that was training while that
checkpoint was written may be trained again with its own rewards in the means (each
weighs at most 1/window there).
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol, cast

from rtrl import plugins
from rtrl.trainer.batch import TrainBatch, TrainSample, collate
from rtrl.trainer.config import TrainerSettings
from rtrl.trainer.objective import context_baseline_advantages
from rtrl.v1 import rollout_pb2

log = logging.getLogger("trainer")

BASELINE_FILE = "baseline.json"
PRIOR_REWARDS = 4.0
"""Weight, in rewards, of the overall mean in a key's baseline: a key's first reward alone
is too noisy to compare the next one with."""
REMEMBERED_BATCHES = 64
"""Batches whose advantages are kept, so a batch trained again (its candidate's base was
refused) gets the same ones, not ones from means that now hold its own rewards."""

ContextKey = Callable[[rollout_pb2.RolloutRecord], str]
"""The product's context of a rollout without a context_key (RTRL_TRAINER_CONTEXT_KEY); "" for
none."""


def no_context(rollout: rollout_pb2.RolloutRecord) -> str:
    """No context of the product's own: every rollout without a context_key shares the global mean."""
    return ""


@dataclass
class RunningMean:
    mean: float = 0.0
    count: int = 0

    def add(self, reward: float, window: float) -> None:
        """A plain mean over the first ``window`` rewards, an exponential moving average after."""
        self.count += 1
        self.mean += (reward - self.mean) / min(self.count, window)


class ContextBaseline:
    """Running means of reward per context key and over all of them."""

    def __init__(self, window: float) -> None:
        if window < 1:
            raise ValueError(f"window {window} < 1")
        self.window = window
        self.by_key: dict[str, RunningMean] = {}
        self.overall = RunningMean()

    def of(self, context: str) -> float | None:
        """A rollout of this context's baseline; None before any reward was seen."""
        if self.overall.count == 0:
            return None
        seen = self.by_key.get(context) if context else None
        if seen is None:
            return self.overall.mean
        weight = min(seen.count, self.window)
        return (weight * seen.mean + PRIOR_REWARDS * self.overall.mean) / (weight + PRIOR_REWARDS)

    def observe(self, contexts: Sequence[str], rewards: Sequence[float]) -> None:
        for context, reward in zip(contexts, rewards, strict=True):
            self.overall.add(reward, self.window)
            if context:
                self.by_key.setdefault(context, RunningMean()).add(reward, self.window)

    def advantages(
        self,
        rewards: Sequence[float],
        groups: Sequence[str],
        contexts: Sequence[str],
        *,
        std_normalize: bool = False,
    ) -> list[float]:
        """The batch's advantages against the means so far; then its rewards join the means."""
        baselines = [self.of(context) for context in contexts]
        advantages = context_baseline_advantages(
            rewards, groups, baselines, std_normalize=std_normalize
        )
        self.observe(contexts, rewards)
        return advantages

    def to_json(self) -> dict:
        return {
            "overall": [self.overall.mean, self.overall.count],
            "by_key": {key: [m.mean, m.count] for key, m in sorted(self.by_key.items())},
        }

    def load_json(self, state: dict) -> None:
        self.overall = RunningMean(*state["overall"])
        self.by_key = {key: RunningMean(*value) for key, value in state["by_key"].items()}


class Baseline(Protocol):
    """What the trainer loop asks of a baseline: each rollout's context, each batch with
    its advantages, and its state saved and loaded beside the checkpoint."""

    def context_of(self, rollout: rollout_pb2.RolloutRecord) -> str: ...

    def collate(self, samples: Sequence[TrainSample]) -> TrainBatch: ...

    def save(self, directory: Path) -> None: ...

    def load(self, directory: Path) -> None: ...


class GroupBaseline:
    """``group``: leave-one-out in the step (trainer/objective.py), nothing kept across steps."""

    def context_of(self, rollout: rollout_pb2.RolloutRecord) -> str:
        return ""

    def collate(self, samples: Sequence[TrainSample]) -> TrainBatch:
        return collate(samples)

    def save(self, directory: Path) -> None:
        pass

    def load(self, directory: Path) -> None:
        pass


class RunningContextBaseline:
    """``context``: a ContextBaseline kept across steps and restarts."""

    def __init__(self, settings: TrainerSettings) -> None:
        self.means = ContextBaseline(settings.baseline_window)
        self.std_normalize = settings.std_normalize
        self.context_key = (
            cast(ContextKey, plugins.load(settings.context_key))
            if settings.context_key
            else no_context
        )
        self._recent: OrderedDict[tuple[str, ...], tuple[float, ...]] = OrderedDict()

    def context_of(self, rollout: rollout_pb2.RolloutRecord) -> str:
        """The context_key the product sent with the request, else the plug-in's."""
        return rollout.context_key or self.context_key(rollout)

    def collate(self, samples: Sequence[TrainSample]) -> TrainBatch:
        batch = collate(samples)
        ids = tuple(sample.rollout_id for sample in samples)
        advantages = self._recent.get(ids)
        if advantages is None:
            contexts = [sample.context for sample in samples]
            advantages = tuple(
                self.means.advantages(
                    batch.rewards, batch.groups, contexts, std_normalize=self.std_normalize
                )
            )
            self._recent[ids] = advantages
            if len(self._recent) > REMEMBERED_BATCHES:
                self._recent.popitem(last=False)
        return replace(batch, advantages=advantages)

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{BASELINE_FILE}.tmp{os.getpid()}"
        tmp.write_text(json.dumps(self.means.to_json()))
        os.replace(tmp, directory / BASELINE_FILE)

    def load(self, directory: Path) -> None:
        path = directory / BASELINE_FILE
        if not path.exists():
            log.info("no saved context baseline: its running means warm up again")
            return
        self.means.load_json(json.loads(path.read_text()))
        log.info(
            "resumed the context baseline: %d keys, %d rewards",
            len(self.means.by_key),
            self.means.overall.count,
        )


def baseline_for(settings: TrainerSettings) -> Baseline:
    if settings.baseline == "context":
        return RunningContextBaseline(settings)
    return GroupBaseline()
