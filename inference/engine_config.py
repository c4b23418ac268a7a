"""What an Engine (inference/engine.py) is built from and what it counts: its config, passed
whole by the worker (inference/server.py) and the benches; its stats, read by the
heartbeat and the metrics (inference/metrics.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from transformers import PretrainedConfig

from rtrl.inference.batch import SwapPolicy
from rtrl.policy import decode, demo_hf_config


def demo_decode(token_ids: Sequence[int]) -> str:
    """The demo policy's ids to text (its character vocabulary)."""
    return decode(list(token_ids))


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 32
    """Most requests of one arm decoded together."""
    batch_wait_s: float = 0.002
    """When an arm is idle, how long its first request waits for others to share its prefill."""
    swap_policy: SwapPolicy = "keep"
    """On a swap, in-flight rows keep their KV cache ("keep") or re-prefill under the new weights ("recompute")."""
    ready_timeout_s: float = 30.0
    """How long a request waits for its arm's first weights before failing."""
    hf_config: PretrainedConfig | None = None
    """The served model's transformers config (a checkpoint's config.json; must match
    the trainer's). None: the built-in demo policy's (rtrl.policy.demo_hf_config)."""
    decode: Callable[[Sequence[int]], str] = demo_decode
    """Generated ids to text, for stop strings and results: the model's tokenizer's."""
    session_kv_tokens: int = 0
    """Positions of agents' keys and values kept between turns, per arm (session_kv.py)."""

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.batch_wait_s < 0 or self.ready_timeout_s <= 0:
            raise ValueError(
                f"batch_wait_s must be >= 0 and ready_timeout_s > 0, got {self.batch_wait_s}, {self.ready_timeout_s}"
            )
        if self.swap_policy not in ("keep", "recompute"):
            raise ValueError(f"swap_policy must be 'keep' or 'recompute', got {self.swap_policy!r}")

    def model_config(self) -> PretrainedConfig:
        """The transformers config of the model served."""
        return demo_hf_config() if self.hf_config is None else self.hf_config


@dataclass
class EngineStats:
    completions: int = 0
    tokens: int = 0
    swaps: int = 0
    batches: int = 0
    """Prefills: groups of requests admitted together."""
    steps: int = 0
    """Decode steps, each over every running request of one arm."""
    swap_pause_s: float = 0.0
    """Time decoding stood still for swaps (the rows' re-prefill included, under "recompute")."""
    aborted: int = 0
    """Requests aborted before they finished (their client went away)."""
