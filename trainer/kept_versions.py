"""The train–inference mismatch measured against the version that sampled each token.

A step measures the mismatch for free on its first forward, but only on tokens sampled by
the very weights it starts from (trainer/mismatch.py), and an asynchronous trainer is
almost always ahead of every version a worker sampled with: this week's demo measured it
on 2 of 229 steps. So the trainer keeps the weights of the last few published versions
and, before a step, runs one forward without gradient under the kept version that sampled
most of its batch, and measures those tokens against what the sampler recorded: kernels,
dtypes, sampling conventions and weights, on most steps.

Cost: up to ``capacity`` copies of the weights (within ``max_bytes``), one more model to
run them in, and one forward (no backward) a step over at most ``max_rows`` of its rows
that the version sampled: a sample of the batch, an eighth of it at the demo's 64.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from rtrl.policy import load_weights
from rtrl.trainer.batch import TrainBatch
from rtrl.trainer.mismatch import Mismatch, measure
from rtrl.trainer.router_replay import replaying
from rtrl.trainer.step import token_logprobs


class KeptVersions:
    """The weights of the most recently published versions: ``capacity`` of them at most,
    fewer if they would take more than ``max_bytes``."""

    def __init__(
        self,
        capacity: int,
        model: Callable[[], torch.nn.Module],
        *,
        max_bytes: int = 1 << 62,
        max_rows: int = 8,
        router_replay: bool = True,
    ) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.max_rows = max_rows
        """Rows of a batch measured at most: a sample of it, so the forward stays cheap."""
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
        each = max(sum(t.nbytes for t in weights.values()), 1)
        keep = min(self.capacity, max(1, self.max_bytes // each))
        while len(self._weights) > keep:
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
        """The mismatch on ``batch``'s tokens of the kept version that sampled most of them
        (``token_versions``: [B, L-1], -1 off the completions), but ``skip``'s: the step
        itself measures the version its weights equal. One version a step: one forward."""
        versions, counts = torch.unique(token_versions, return_counts=True)
        candidates = [
            (n, v)
            for v, n in zip(versions.tolist(), counts.tolist(), strict=True)
            if v in self._weights and v != skip
        ]
        if not candidates:
            return Mismatch()
        _, version = max(candidates)
        rows = (token_versions == version).any(dim=1).nonzero()[:, 0][: self.max_rows]
        sub = batch.select(rows.tolist())
        model = self._model_with(version, self._weights[version])
        with torch.no_grad(), replaying(sub, (model,), enabled=self._router_replay):
            logp, _ = token_logprobs(model, sub)
        return measure(
            logp, sub.behaviour_logprobs, token_versions[rows], version, sub.target_mask, threshold
        )

    def _model_with(self, version: int, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
        if self._model is None:
            self._model = self._make_model()
            self._model.requires_grad_(False)
            self._model.eval()
        if self._loaded != version:
            load_weights(self._model, weights)
            self._loaded = version
        return self._model
