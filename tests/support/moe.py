"""Helpers for tests of mixture-of-experts routing (rtrl/moe.py)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from rtrl.moe import routers
from rtrl.trainer.distributed import World


def tie_experts(model: PreTrainedModel, tied: int, spread: float = 3e-9) -> None:
    """Make each router's rows of experts 1..tied-1 equal to expert 0's up to ``spread``:
    which of them wins is then decided by rounding, as for a large MoE's near-ties."""
    noise = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for router in routers(model):
            weight = router.module.get_parameter("weight")
            for expert in range(1, tied):
                jitter = torch.randn(weight.shape[1], generator=noise)
                weight[expert] = weight[0] + spread * jitter


@contextmanager
def one_rank_group() -> Iterator[World]:
    """A one-rank gloo process group on a free port: the sharded code's collectives run."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield World(0, 1)
    finally:
        dist.destroy_process_group()
