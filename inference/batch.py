"""One static micro-batch decoded in lockstep with the model's KV cache.

Prompts are left-padded so every row's next token sits in the last column; each
row's position ids count only its real tokens, so a padded row computes exactly
what it would alone. Rows leave the batch (and the cache) as soon as they finish.
Every step samples one token per row under one weight version, so the version of a
token is a per-step fact, not a per-row one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from transformers import DynamicCache

from inference.sampling import sample
from rtrl.policy import EOS, PAD, decode

SwapPolicy = Literal["keep", "recompute"]
FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SequenceParams:
    """What the engine asks a batch to generate for one request."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class SequenceResult:
    """One finished row. versions[i] is the weight version that sampled token_ids[i]."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finish_reason: FinishReason
    text: str


class DecodeBatch:
    """Not thread-safe: owned by the engine thread. Call under torch.inference_mode()."""

    def __init__(self, model: torch.nn.Module, sequences: list[SequenceParams], version: int) -> None:
        self.model = model
        self.version = version
        n = len(sequences)
        self.prompt_width = max(len(s.prompt_ids) for s in sequences)
        width = self.prompt_width + max(s.max_tokens for s in sequences)
        self.ids = torch.full((n, width), PAD, dtype=torch.long)
        self.mask = torch.ones((n, width), dtype=torch.long)
        for row, seq in enumerate(sequences):
            pad = self.prompt_width - len(seq.prompt_ids)
            self.ids[row, pad : self.prompt_width] = torch.tensor(seq.prompt_ids)
            self.mask[row, :pad] = 0
        self.prompt_lens = torch.tensor([len(s.prompt_ids) for s in sequences])
        self.max_tokens = torch.tensor([s.max_tokens for s in sequences])
        self.temperature = torch.tensor([s.temperature for s in sequences], dtype=torch.float32)
        self.top_p = torch.tensor([s.top_p for s in sequences], dtype=torch.float32)
        self.seeds = torch.tensor([s.seed for s in sequences], dtype=torch.int64)
        self.logprobs = torch.zeros((n, width - self.prompt_width), dtype=torch.float32)
        self.stops = [s.stop for s in sequences]
        # rows[i] is the original index of active row i.
        self.rows = torch.arange(n)
        self.step_versions: list[int] = []
        self.cache: DynamicCache | None = None
        self._recompute = False

    @property
    def generated(self) -> int:
        return len(self.step_versions)

    @property
    def done(self) -> bool:
        return len(self.rows) == 0

    def swap(self, version: int, policy: SwapPolicy) -> None:
        """The model's weights were just replaced: tag later tokens with ``version``;
        "recompute" rebuilds the cache of everything so far under the new weights."""
        self.version = version
        self._recompute = self._recompute or policy == "recompute"

    def step(self) -> list[tuple[int, SequenceResult]]:
        """Sample the next token of every active row; returns the rows that finished
        as (original index, result). The first call is the prefill."""
        t = self.generated
        end = self.prompt_width + t
        if self.cache is None or self._recompute:
            mask = self.mask[:, :end]
            positions = (mask.cumsum(-1) - 1).clamp_min(0)
            out = self.model(
                input_ids=self.ids[:, :end], attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1
            )
            self._recompute = False
        else:
            out = self.model(
                input_ids=self.ids[:, end - 1 : end],
                attention_mask=self.mask[:, :end],
                position_ids=(self.prompt_lens + t - 1).unsqueeze(-1),
                past_key_values=self.cache,
                use_cache=True,
            )
        self.cache = out.past_key_values
        tokens, logprobs = sample(out.logits[:, -1], self.temperature, self.top_p, self.seeds, t)
        self.ids[:, end] = tokens
        self.logprobs[:, t] = logprobs
        self.step_versions.append(self.version)
        finished = (tokens == EOS) | (self.max_tokens <= t + 1)
        stopped_text = self._check_stops(finished, end + 1)
        if not bool(finished.any()):
            return []
        done = finished.nonzero().squeeze(-1).tolist()
        results = [(int(self.rows[i]), self._result(i, end + 1, stopped_text.get(i))) for i in done]
        self._keep(torch.nonzero(~finished).squeeze(-1))
        return results

    def _check_stops(self, finished: torch.Tensor, end: int) -> dict[int, str]:
        """Marks rows whose text now contains a stop string; returns their truncated text."""
        stopped: dict[int, str] = {}
        if not any(self.stops):
            return stopped
        for i, stops in enumerate(self.stops):
            if not stops or finished[i]:
                continue
            text = decode(self.ids[i, self.prompt_width : end].tolist())
            hits = [text.find(s) for s in stops if s in text]
            if hits:
                finished[i] = True
                stopped[i] = text[: min(hits)]
        return stopped

    def _result(self, i: int, end: int, stopped_text: str | None) -> SequenceResult:
        token_ids = self.ids[i, self.prompt_width : end].tolist()
        hit_eos = token_ids[-1] == EOS
        return SequenceResult(
            token_ids=tuple(token_ids),
            logprobs=tuple(self.logprobs[i, : len(token_ids)].tolist()),
            versions=tuple(self.step_versions),
            finish_reason="stop" if hit_eos or stopped_text is not None else "length",
            text=stopped_text if stopped_text is not None else decode(token_ids),
        )

    def _keep(self, keep: torch.Tensor) -> None:
        if len(keep) == len(self.rows):
            return
        self.rows = self.rows[keep]
        if len(keep) == 0:
            return
        for name in ("ids", "mask", "prompt_lens", "max_tokens", "temperature", "top_p", "seeds", "logprobs"):
            setattr(self, name, getattr(self, name)[keep])
        self.stops = [self.stops[i] for i in keep.tolist()]
        self.cache.batch_select_indices(keep)
