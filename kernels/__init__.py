"""Hot loops shared by the trainer, weight_sync and inference.

Each kernel has a portable torch path and faster device paths beside it, tested
bit-identical against it: ``delta`` (torch), ``delta_cpu`` (numba, fused),
``triton_delta`` (GPUs). ``delta_encode``/``delta_apply`` here pick the fastest path
for the tensors' device.
"""

from __future__ import annotations

import torch

from kernels import delta as _torch_path
from kernels.delta import SparseDelta, bits_dtype


def _path(tensor: torch.Tensor):
    if tensor.device.type == "cpu":
        from kernels import delta_cpu

        return delta_cpu
    if tensor.device.type == "cuda":
        try:
            from kernels import triton_delta
        except ImportError:
            return _torch_path
        return triton_delta
    return _torch_path


def delta_encode(old: torch.Tensor, new: torch.Tensor) -> SparseDelta:
    """The sparse delta old -> new, on the fastest path for their device."""
    return _path(new).delta_encode(old, new)


def delta_apply(old: torch.Tensor, delta: SparseDelta) -> torch.Tensor:
    """old with the delta applied (a new tensor), on the fastest path for old's device."""
    return _path(old).delta_apply(old, delta)


__all__ = ["SparseDelta", "bits_dtype", "delta_apply", "delta_encode"]
