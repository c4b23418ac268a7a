"""Lossless sparse delta between two tensors: where bits changed, and by how much.

A delta holds the flat positions of the elements whose bit pattern changed and, at
each, the difference of the new and old bit patterns as integers, with wrapping
two's-complement arithmetic. Applying it adds the differences back (wrapping
again), which reproduces the new tensor bit for bit: the arithmetic is on bit
patterns, never on float values, so nothing rounds, and NaN payloads and -0.0
survive.

Why a difference rather than an XOR: between two RL steps a bf16 weight usually
moves by one unit in the last place, and as integers that is ±1 whatever the
mantissa, while the XOR of a +1 step depends on the carry chain (1, 3, 7, 15…).
On a real fine-tune the differences carry a third less entropy than the XORs.

This module is the portable torch path (any device). kernels.delta_cpu is the fused
CPU path and kernels.triton_delta the GPU path; tests hold all three bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Integer dtype of the same width, used to read a tensor's bit patterns.
_BITS_BY_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The signed integer dtype whose width equals ``dtype``'s (int32 for fp32, int16 for bf16)."""
    width = torch.empty((), dtype=dtype).element_size()
    if width not in _BITS_BY_WIDTH or dtype.is_complex or dtype == torch.bool:
        raise TypeError(f"no sparse delta for dtype {dtype}")
    return _BITS_BY_WIDTH[width]


@dataclass(frozen=True)
class SparseDelta:
    """Produced by a delta_encode; consumed by a delta_apply and by weight_sync.codec."""

    positions: torch.Tensor
    """int64, 1-D, strictly increasing flat indices of the elements whose bits changed."""
    diffs: torch.Tensor
    """bits_dtype(tensor dtype), 1-D, same length: new bits minus old bits, wrapping; never 0."""

    @property
    def changed(self) -> int:
        return self.positions.numel()


def flat_bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns as a flat signed-integer view (a copy only if not contiguous)."""
    return tensor.contiguous().reshape(-1).view(bits_dtype(tensor.dtype))


def check_pair(old: torch.Tensor, new: torch.Tensor) -> None:
    if old.shape != new.shape or old.dtype != new.dtype:
        raise ValueError(
            f"delta needs equal shape and dtype, got {tuple(old.shape)}/{old.dtype} and {tuple(new.shape)}/{new.dtype}"
        )


def check_delta(delta: SparseDelta, dtype: torch.dtype, numel: int) -> None:
    """A delta must name each position once, in order, inside the tensor: a bad one would
    silently change the wrong element."""
    positions, diffs = delta.positions, delta.diffs
    if (
        positions.dtype != torch.int64
        or diffs.dtype != bits_dtype(dtype)
        or positions.dim() != 1
        or positions.shape != diffs.shape
    ):
        raise ValueError(
            f"malformed delta for {dtype}: positions {positions.dtype}{tuple(positions.shape)}, "
            f"diffs {diffs.dtype}{tuple(diffs.shape)}"
        )
    if positions.numel() and (
        bool(positions[0] < 0)
        or bool((positions[1:] <= positions[:-1]).any())
        or int(positions[-1]) >= numel
    ):
        raise ValueError(f"delta positions are not strictly increasing within {numel} elements")


def delta_encode(old: torch.Tensor, new: torch.Tensor) -> SparseDelta:
    """The delta that turns ``old`` into ``new`` (same shape, dtype and device)."""
    check_pair(old, new)
    old_bits, new_bits = flat_bits(old), flat_bits(new)
    positions = torch.nonzero(old_bits != new_bits).reshape(-1)
    # Integer subtraction on tensors wraps (two's complement), which is what we want.
    return SparseDelta(positions=positions, diffs=new_bits[positions] - old_bits[positions])


def delta_apply(old: torch.Tensor, delta: SparseDelta) -> torch.Tensor:
    """A new tensor equal, bit for bit, to the ``new`` the delta was encoded from. ``old`` is untouched."""
    check_delta(delta, old.dtype, old.numel())
    flat = flat_bits(old).clone()
    if delta.changed:
        positions = delta.positions.to(flat.device)
        flat[positions] += delta.diffs.to(flat.device)
    return flat.view(old.dtype).reshape(old.shape)
