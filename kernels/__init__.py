"""Hot loops shared by the trainer, weight_sync and inference.

Each kernel has a portable torch path and faster device paths beside it, tested
bit-identical against it: ``delta`` (torch), ``delta_cpu`` (numba, fused),
``triton_delta`` (GPUs); ``mxfp8`` (torch) and ``triton_mxfp8`` (GPUs) for serving
fleets that run FP8. The functions here pick the fastest path for the tensors' device.
"""

from __future__ import annotations

import importlib

import torch

from rtrl.kernels import delta as _torch_path
from rtrl.kernels import mxfp8 as _mxfp8_torch
from rtrl.kernels.delta import SparseDelta, bits_dtype
from rtrl.kernels.mxfp8 import MXFP8Tensor


def _triton_or(module_name: str, fallback):
    try:
        return importlib.import_module(module_name)
    except ImportError:
        return fallback


def _path(tensor: torch.Tensor):
    if tensor.device.type == "cpu":
        from rtrl.kernels import delta_cpu

        return delta_cpu
    if tensor.device.type == "cuda":
        return _triton_or("rtrl.kernels.triton_delta", _torch_path)
    return _torch_path


def delta_encode(old: torch.Tensor, new: torch.Tensor) -> SparseDelta:
    """The sparse delta old -> new, on the fastest path for their device."""
    return _path(new).delta_encode(old, new)


def delta_apply(old: torch.Tensor, delta: SparseDelta) -> torch.Tensor:
    """old with the delta applied (a new tensor), on the fastest path for old's device."""
    return _path(old).delta_apply(old, delta)


def mxfp8_quantize(x: torch.Tensor) -> MXFP8Tensor:
    """MXFP8 (E4M3 elements, one E8M0 scale per 32) of x, fused on GPUs."""
    path = (
        _triton_or("rtrl.kernels.triton_mxfp8", _mxfp8_torch)
        if x.device.type == "cuda"
        else _mxfp8_torch
    )
    return path.mxfp8_quantize(x)


def mxfp8_dequantize(
    data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    path = (
        _triton_or("rtrl.kernels.triton_mxfp8", _mxfp8_torch)
        if data.device.type == "cuda"
        else _mxfp8_torch
    )
    return path.mxfp8_dequantize(data, scales, dtype)


__all__ = [
    "MXFP8Tensor",
    "SparseDelta",
    "bits_dtype",
    "delta_apply",
    "delta_encode",
    "mxfp8_dequantize",
    "mxfp8_quantize",
]
