"""The trainer's checkpoint: model, optimizer and counters, written atomically."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FILENAME = "checkpoint.pt"


@dataclass(frozen=True)
class Checkpoint:
    step: int
    version: int
    """Treatment version these weights were published as."""
    rollouts_trained: int
    warm_start: str
    """File name of the warm start this run started from (its cache key)."""
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]


def save(directory: Path, checkpoint: Checkpoint) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / FILENAME
    tmp = directory / f".{FILENAME}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(checkpoint.__dict__, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load(directory: Path) -> Checkpoint | None:
    path = directory / FILENAME
    if not path.exists():
        return None
    return Checkpoint(**torch.load(path, weights_only=True))
