"""Lossless sparse delta between two tensors: where bits changed, and how.

A delta holds the flat positions of the elements whose bit pattern changed
(gap-encoded int64, so nearby changes give small, compressible numbers) and the
XOR of old and new bit patterns at those positions. Applying it reproduces the new
tensor bit for bit: it never adds float differences, which would round, and it
compares bit patterns rather than values, so NaN payloads and -0.0 survive.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Integer dtype of the same width, used to read a tensor's bit patterns.
_BITS_BY_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The signed integer dtype whose width equals ``dtype``'s (int32 for fp32, int16 for bf16)."""
    width = torch.empty((), dtype=dtype).element_size()
    if width not in _BITS_BY_WIDTH or dtype.is_complex:
        raise TypeError(f"no sparse XOR delta for dtype {dtype}")
    return _BITS_BY_WIDTH[width]


@dataclass(frozen=True)
class SparseXorDelta:
    """Produced by delta_encode; consumed by delta_apply (and serialised by weight_sync.codec)."""

    gaps: torch.Tensor
    """int64, 1-D: first changed flat index, then the distance to each next one (all > 0)."""
    xor: torch.Tensor
    """bits_dtype(tensor dtype), 1-D, same length as gaps: old bits XOR new bits."""

    @property
    def changed(self) -> int:
        return self.gaps.numel()


def _flat_bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(bits_dtype(tensor.dtype))


def delta_encode(old: torch.Tensor, new: torch.Tensor) -> SparseXorDelta:
    """The delta that turns ``old`` into ``new`` (same shape, dtype and device)."""
    if old.shape != new.shape or old.dtype != new.dtype:
        raise ValueError(f"delta needs equal shape and dtype, got {tuple(old.shape)}/{old.dtype} and {tuple(new.shape)}/{new.dtype}")
    old_bits, new_bits = _flat_bits(old), _flat_bits(new)
    positions = torch.nonzero(old_bits != new_bits).reshape(-1)
    gaps = torch.diff(positions, prepend=positions.new_zeros(1))
    return SparseXorDelta(gaps=gaps, xor=old_bits[positions] ^ new_bits[positions])


def delta_apply(old: torch.Tensor, delta: SparseXorDelta) -> torch.Tensor:
    """A new tensor equal, bit for bit, to the ``new`` the delta was encoded from. ``old`` is untouched."""
    bits = bits_dtype(old.dtype)
    if delta.gaps.dtype != torch.int64 or delta.xor.dtype != bits or delta.gaps.shape != delta.xor.shape:
        raise ValueError(
            f"malformed delta for {old.dtype}: gaps {delta.gaps.dtype}{tuple(delta.gaps.shape)}, "
            f"xor {delta.xor.dtype}{tuple(delta.xor.shape)}"
        )
    flat = _flat_bits(old).clone()
    if delta.changed:
        positions = torch.cumsum(delta.gaps.to(flat.device), 0)
        # A bad gap would silently hit the wrong element; a delta must name each position once, in order.
        if bool(delta.gaps[0] < 0) or bool((delta.gaps[1:] <= 0).any()) or int(positions[-1]) >= flat.numel():
            raise ValueError(f"delta positions are not strictly increasing within {flat.numel()} elements")
        flat[positions] ^= delta.xor.to(flat.device)
    return flat.view(old.dtype).reshape(old.shape)
