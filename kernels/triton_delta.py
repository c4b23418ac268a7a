"""The sparse delta codec as Triton kernels: the GPU path of kernels.delta.

Results are bit-identical to kernels.delta (same SparseDelta, same validation). All
arithmetic is on the tensors' bit patterns viewed as signed integers of the same
width, so the kernels never see a float and every dtype of width 1, 2, 4 or 8 bytes
goes through the same code.

Encoding is a stream compaction in two passes over the data: the first counts the
changed elements of each block, an exclusive prefix sum of those counts gives each
block its first output slot, and the second pass writes the positions and wrapped
differences of its changed elements from that slot on, in order. Applying is a
scatter that adds each difference at its position in a copy of ``old``; positions
are strictly increasing, so no two programs touch the same element.

Under ``TRITON_INTERPRET=1`` (set before triton is imported) the kernels run on CPU
tensors, which is how the tests hold them to the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rtrl.kernels.delta import SparseDelta, check_delta, check_pair, flat_bits

ENCODE_BLOCK = 1024
"""Elements compared per program; one count per block."""
APPLY_BLOCK = 1024
"""Changed positions scattered per program."""


@triton.jit
def _count_changes(old_ptr, new_ptr, counts_ptr, numel, BLOCK: tl.constexpr):
    block = tl.program_id(0)
    offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = offsets < numel
    old = tl.load(old_ptr + offsets, mask=in_range, other=0)
    new = tl.load(new_ptr + offsets, mask=in_range, other=0)
    tl.store(counts_ptr + block, tl.sum((old != new).to(tl.int32), axis=0))


@triton.jit
def _compact_changes(
    old_ptr, new_ptr, starts_ptr, positions_ptr, diffs_ptr, numel, BLOCK: tl.constexpr
):
    block = tl.program_id(0)
    offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = offsets < numel
    # Out-of-range lanes load equal values, so they never count as changed.
    old = tl.load(old_ptr + offsets, mask=in_range, other=0)
    new = tl.load(new_ptr + offsets, mask=in_range, other=0)
    changed = old != new
    flags = changed.to(tl.int64)
    slots = tl.load(starts_ptr + block) + tl.cumsum(flags, axis=0) - flags
    tl.store(positions_ptr + slots, offsets, mask=changed)
    tl.store(diffs_ptr + slots, new - old, mask=changed)


@triton.jit
def _scatter_add(bits_ptr, positions_ptr, diffs_ptr, changed, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = offsets < changed
    positions = tl.load(positions_ptr + offsets, mask=in_range, other=0)
    diffs = tl.load(diffs_ptr + offsets, mask=in_range, other=0)
    current = tl.load(bits_ptr + positions, mask=in_range)
    tl.store(bits_ptr + positions, current + diffs, mask=in_range)


def delta_encode(old: torch.Tensor, new: torch.Tensor) -> SparseDelta:
    """The delta that turns ``old`` into ``new`` (same shape, dtype and device)."""
    check_pair(old, new)
    old_bits, new_bits = flat_bits(old), flat_bits(new)
    numel = old_bits.numel()
    blocks = triton.cdiv(numel, ENCODE_BLOCK)
    counts = torch.zeros(blocks, dtype=torch.int64, device=old_bits.device)
    if blocks:
        _count_changes[(blocks,)](old_bits, new_bits, counts, numel, BLOCK=ENCODE_BLOCK)
    starts = torch.cumsum(counts, 0) - counts
    # The one host sync: the output size.
    changed = int(counts.sum())
    positions = torch.empty(changed, dtype=torch.int64, device=old_bits.device)
    diffs = torch.empty(changed, dtype=old_bits.dtype, device=old_bits.device)
    if changed:
        _compact_changes[(blocks,)](
            old_bits, new_bits, starts, positions, diffs, numel, BLOCK=ENCODE_BLOCK
        )
    return SparseDelta(positions=positions, diffs=diffs)


def delta_apply(old: torch.Tensor, delta: SparseDelta) -> torch.Tensor:
    """A new tensor equal, bit for bit, to the ``new`` the delta was encoded from. ``old`` is untouched."""
    check_delta(delta, old.dtype, old.numel())
    bits = flat_bits(old).clone()
    if delta.changed:
        positions = delta.positions.to(bits.device).contiguous()
        diffs = delta.diffs.to(bits.device).contiguous()
        grid = (triton.cdiv(delta.changed, APPLY_BLOCK),)
        _scatter_add[grid](bits, positions, diffs, delta.changed, BLOCK=APPLY_BLOCK)
    return bits.view(old.dtype).reshape(old.shape)
