"""The train–inference mismatch measured against the version that sampled each token.

A step measures the mismatch for free on its first forward, but only on tokens sampled by
the very weights it starts from (trainer/mismatch.py), and an asynchronous trainer is
almost always ahead of every version a worker sampled with: this week's demo measured it
on 2 of 229 steps. So the trainer keeps the weights of the last few published versions
and, before a step, runs one forward without gradient under each kept version its batch
has tokens of, and measures those tokens against what the sampler recorded: kernels,
dtypes, sampling conventions and weights, on most steps.

Cost: ``capacity`` copies of the weights, one more model to run them in, and one forward
(no backward) per kept version present in a batch, about a third of a step each.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from rtrl.policy import load_weights
from rtrl.trainer.batch import TrainBatch
from rtrl.trainer.mismatch import Mismatch, measure, merge
from rtrl.trainer.router_replay import replaying
from rtrl.trainer.step import token_logprobs


class KeptVersions:
    """The weights of the ``capacity`` most recently published versions."""

    def __init__(
        self, capacity: int, model: Callable[[], torch.nn.Module], *, router_replay: bool = True
    ) -> None:
        self.capacity = capacity
        self._router_replay = router_replay
        self._weights: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self._make_model = model
        self._model: torch.nn.Module | None = None
        self._loaded: int | None = None

    def keep(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        """A version was published with exactly these weights (kept by reference: they
        must not change afterwards)."""
        if self.capacity == 0:
            return
        self._weights[version] = weights
        self._weights.move_to_end(version)
        while len(self._weights) > self.capacity:
            self._weights.popitem(last=False)

    def versions(self) -> tuple[int, ...]:
        return tuple(self._weights)

    def measure(
        self,
        batch: TrainBatch,
        token_versions: torch.Tensor,
        threshold: float,
        skip: int | None = None,
    ) -> Mismatch:
        """The mismatch on ``batch``'s tokens sampled by kept versions (``token_versions``:
        [B, L-1], -1 off the completions), but ``skip``'s: the step itself measures the
        version its weights equal."""
        present = set(torch.unique(token_versions).tolist())
        parts = []
        for version, weights in self._weights.items():
            if version not in present or version == skip:
                continue
            model = self._model_with(version, weights)
            with torch.no_grad(), replaying(batch, (model,), enabled=self._router_replay):
                logp, _ = token_logprobs(model, batch)
            parts.append(
                measure(
                    logp,
                    batch.behaviour_logprobs,
                    token_versions,
                    version,
                    batch.target_mask,
                    threshold,
                )  # fmt: skip
            )
        return merge(parts)

    def _model_with(self, version: int, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
        if self._model is None:
            self._model = self._make_model()
            self._model.requires_grad_(False)
            self._model.eval()
        if self._loaded != version:
            load_weights(self._model, weights)
            self._loaded = version
        return self._model
