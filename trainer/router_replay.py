"""The trainer's forwards of a MoE policy routed as its sampler routed (rtrl/moe.py).

Without replay, the trainer's top-k re-decides every token's experts; where two experts
are nearly tied, the rounding of a full-sequence forward (against the sampler's
incremental decode, or its batch, or its kernels) picks the other one, and that token's
log-prob, and through attention every later one's, moves by far more than the rounding
did. The importance ratio then corrects for routing noise instead of for the policy.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager

import torch

from rtrl.moe import replay_routes
from rtrl.trainer.batch import TrainBatch


@contextmanager
def replaying(
    batch: TrainBatch, models: Sequence[torch.nn.Module | None], *, enabled: bool = True
) -> Iterator[None]:
    """Every forward of ``models`` over ``batch.input_ids`` inside the block uses the batch's
    recorded experts (the policy's and the reference's: k1's logp − ref then compares two
    sets of weights under one routing). Does nothing when disabled or when the batch has no
    routes (a dense policy, or a rollout without them); a model whose MoE layers do not
    match the routes raises (rtrl.moe.replay_routes)."""
    with ExitStack() as stack:
        if enabled and batch.router_choices is not None:
            for model in models:
                if model is not None:
                    stack.enter_context(replay_routes(model, batch.router_choices))
        yield
