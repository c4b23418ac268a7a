"""The trainer's side of weight_sync: the two arms it publishes, one publisher per arm,
and a way to read back a version it published (a resume from what the fleet serves).

Control is published once, as the warm start, and never trained; treatment gets every
candidate the eval gate accepts (trainer/loop.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from rtrl.v1 import weights_pb2

CONTROL, TREATMENT = "control", "treatment"


class WeightPublisher(Protocol):
    """One arm's side of weight_sync (weight_sync.client.Publisher)."""

    def publish(
        self,
        weights: dict[str, torch.Tensor],
        *,
        trained_through_event_ts_ms: int = 0,
        rollouts_trained: int = 0,
        train_step: int = 0,
    ) -> int: ...

    def latest(self) -> int: ...


# Reads the manifest and weights weight_sync holds for (arm, version); used to
# resume when the checkpoint is behind what was published.
FetchWeights = Callable[[str, int], tuple[weights_pb2.Manifest, dict[str, torch.Tensor]]]
