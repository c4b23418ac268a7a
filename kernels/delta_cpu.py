"""The CPU path of the sparse delta: one fused pass, compiled with numba.

The torch path (kernels.delta) makes four passes over the weights (compare, find
the changed elements, gather old, gather new); at ~0.6 % changed elements each pass
costs about as much as copying the weights. Here one loop reads old and new once,
eight bytes at a time, and looks at individual elements only inside the words that
differ, so encoding a model costs about two copies of it instead of ten.
Results are identical to kernels.delta (tests/test_kernels_cpu.py).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from kernels.delta import SparseDelta, check_delta, check_pair, flat_bits


def _changes_kernel(lanes: int):
    """The fused loop for elements of 8 // lanes bytes; lanes is a compile-time constant
    so the per-word loop unrolls (a third faster than reading it from itemsize)."""

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def changes(old, new, old_words, new_words, positions, diffs):  # pragma: no cover - compiled
        """Fill positions/diffs with the changed elements of old -> new; return their count.

        old_words/new_words are the same memory read as int64 words (empty when the
        tensor is not 8-byte aligned), covering the first len(old_words) * lanes elements.
        """
        count = 0
        for word in range(old_words.size):
            if old_words[word] != new_words[word]:
                base = word * lanes
                for lane in range(lanes):
                    i = base + lane
                    if old[i] != new[i]:
                        positions[count] = i
                        diffs[count] = new[i] - old[i]
                        count += 1
        for i in range(old_words.size * lanes, old.size):
            if old[i] != new[i]:
                positions[count] = i
                diffs[count] = new[i] - old[i]
                count += 1
        return count

    return changes


_CHANGES = {width: _changes_kernel(8 // width) for width in (1, 2, 4, 8)}


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _add_at(flat, positions, diffs):  # pragma: no cover - compiled
    for i in range(positions.size):
        flat[positions[i]] += diffs[i]


def _words(bits: np.ndarray) -> np.ndarray:
    whole = bits.size * bits.itemsize // 8 * 8 // bits.itemsize
    if bits.ctypes.data % 8:
        return np.empty(0, dtype=np.int64)
    return bits[:whole].view(np.int64)


def changes(
    old_bits: np.ndarray,
    new_bits: np.ndarray,
    scratch: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(positions, diffs) of the changed elements between two flat signed-integer arrays
    of one dtype: the numpy core of delta_encode, for callers that hold numpy views.

    ``scratch`` (from scratch_for) saves allocating worst-case buffers per call when
    encoding many tensors; the results never alias it.
    """
    if scratch is None or scratch[0].size < old_bits.size:
        scratch = scratch_for(old_bits.size)
    positions, diffs = scratch[0], scratch[1].view(old_bits.dtype)
    old_words, new_words = _words(old_bits), _words(new_bits)
    if old_words.size != new_words.size:
        old_words = new_words = np.empty(0, dtype=np.int64)
    count = _CHANGES[old_bits.itemsize](old_bits, new_bits, old_words, new_words, positions, diffs)
    return positions[:count].copy(), diffs[:count].copy()


def scratch_for(numel: int) -> tuple[np.ndarray, np.ndarray]:
    """Worst-case output buffers for tensors of up to numel elements. Only the pages
    that get written are ever touched, so a sparse delta costs address space, not memory."""
    return np.empty(numel, dtype=np.int64), np.empty(numel, dtype=np.int64)


def delta_encode(old: torch.Tensor, new: torch.Tensor) -> SparseDelta:
    """The delta that turns ``old`` into ``new``: CPU tensors of equal shape and dtype."""
    check_pair(old, new)
    positions, diffs = changes(flat_bits(old.detach().cpu()).numpy(), flat_bits(new.detach().cpu()).numpy())
    return SparseDelta(positions=torch.from_numpy(positions), diffs=torch.from_numpy(diffs))


def delta_apply(old: torch.Tensor, delta: SparseDelta) -> torch.Tensor:
    """A new CPU tensor equal, bit for bit, to the ``new`` the delta was encoded from. ``old`` is untouched."""
    old = old.detach().cpu()
    check_delta(delta, old.dtype, old.numel())
    flat = flat_bits(old).clone()
    if delta.changed:
        _add_at(flat.numpy(), delta.positions.numpy(), delta.diffs.numpy())
    return flat.view(old.dtype).reshape(old.shape)
