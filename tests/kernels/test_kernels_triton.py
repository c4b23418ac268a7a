"""The Triton delta kernels against the torch path, bit for bit.

Under TRITON_INTERPRET=1 (the default here) the kernels run on CPU tensors; run with
TRITON_INTERPRET=0 on a machine with a GPU to hold the compiled kernels to the same cases.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# Must be set before triton is imported: triton.jit reads it when it decorates a kernel.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip(
    "triton",
    reason="the Triton kernels need the gpu extra: pip install -c constraints.txt -e '.[gpu]'",
)

from rtrl.kernels import delta as torch_delta
from rtrl.kernels import triton_delta
from rtrl.kernels.delta import SparseDelta, flat_bits

DEVICE = "cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda"
# One of each width, and the float formats the weights actually come in.
DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.int8,
    torch.float64,
]
# Around the kernels' block of 1024, and a few blocks.
SIZES = [0, 1, 1023, 1024, 1025, 3 * 1024 + 7]
DENSITIES = [0.0, 0.003, 0.5, 1.0]


def random_pair(
    numel: int, dtype: torch.dtype, density: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bit patterns for old; new changes a ``density`` share of them to other random patterns."""
    generator = torch.Generator().manual_seed(seed)
    bits = torch_delta.bits_dtype(dtype)
    info = torch.iinfo(bits)
    old_bits = torch.randint(info.min, info.max, (numel,), generator=generator, dtype=bits)
    new_bits = old_bits.clone()
    changed = torch.rand(numel, generator=generator) < density
    # Adding a nonzero wraps to a different pattern, so exactly the chosen elements change.
    step = torch.randint(1, info.max, (numel,), generator=generator, dtype=bits)
    new_bits[changed] += step[changed]
    return old_bits.view(dtype).to(DEVICE), new_bits.view(dtype).to(DEVICE)


def assert_same_delta(got: SparseDelta, want: SparseDelta) -> None:
    assert got.positions.dtype == want.positions.dtype and got.diffs.dtype == want.diffs.dtype
    assert torch.equal(got.positions, want.positions)
    assert torch.equal(got.diffs, want.diffs)


def assert_bit_identical(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(flat_bits(got), flat_bits(want))


@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_encode_and_apply_match_torch(dtype, numel, density):
    old, new = random_pair(numel, dtype, density, seed=numel)
    want = torch_delta.delta_encode(old, new)
    got = triton_delta.delta_encode(old, new)
    assert_same_delta(got, want)
    if density in (0.0, 1.0):
        assert got.changed == (0 if density == 0.0 else numel)
    assert_bit_identical(triton_delta.delta_apply(old, got), new)
    assert_bit_identical(triton_delta.delta_apply(old, want), torch_delta.delta_apply(old, want))


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 40), min_size=1, max_size=3),
    density=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_shapes_round_trip(dtype, shape, density, seed):
    numel = int(torch.tensor(shape).prod())
    old, new = random_pair(numel, dtype, density, seed)
    old, new = old.reshape(shape), new.reshape(shape)
    delta = triton_delta.delta_encode(old, new)
    assert_same_delta(delta, torch_delta.delta_encode(old, new))
    assert_bit_identical(triton_delta.delta_apply(old, delta), new)


@pytest.mark.parametrize(
    "dtype, old_bits, new_bits, diff",
    [
        # The differences wrap: one step past the largest pattern is the smallest.
        (torch.int8, 127, -128, 1),
        (torch.int8, -128, 127, -1),
        # bf16 +max finite to -0.0: 0x7F7F -> 0x8000 wraps through the sign bit.
        (torch.bfloat16, 0x7F7F, -0x8000, 0x0081),
        (torch.float32, -(2**31), 2**31 - 1, -1),
        (torch.float64, 2**63 - 1, -(2**63), 1),
        # Equal values, different bits: +0.0 and -0.0, two NaN payloads.
        (torch.float32, 0, -(2**31), -(2**31)),
        (torch.float16, 0x7E00, 0x7E01, 1),
    ],
)
def test_wrapping_and_value_equal_changes(dtype, old_bits, new_bits, diff):
    bits = torch_delta.bits_dtype(dtype)
    old = torch.tensor([0, old_bits, 0], dtype=bits).view(dtype).to(DEVICE)
    new = torch.tensor([0, new_bits, 0], dtype=bits).view(dtype).to(DEVICE)
    delta = triton_delta.delta_encode(old, new)
    assert delta.positions.tolist() == [1] and delta.diffs.tolist() == [diff]
    assert_same_delta(delta, torch_delta.delta_encode(old, new))
    assert_bit_identical(triton_delta.delta_apply(old, delta), new)


def test_non_contiguous_inputs_and_old_untouched():
    old, new = random_pair(48 * 40, torch.bfloat16, 0.2, seed=7)
    old, new = old.reshape(48, 40).t(), new.reshape(48, 40).t()
    before = old.clone()
    delta = triton_delta.delta_encode(old, new)
    assert_same_delta(delta, torch_delta.delta_encode(old, new))
    applied = triton_delta.delta_apply(old, delta)
    assert_bit_identical(applied, new.contiguous())
    assert_bit_identical(old, before)


@pytest.mark.parametrize(
    "positions, diffs, error",
    [
        # Each breaks one rule of a delta; all must be refused before any element changes.
        ([3, 3], [1, 1], "strictly increasing"),
        ([5, 2], [1, 1], "strictly increasing"),
        ([0, 10], [1, 1], "strictly increasing"),
        ([-1], [1], "strictly increasing"),
        ([1, 2], [1], "malformed"),
    ],
)
def test_apply_refuses_bad_deltas(positions, diffs, error):
    old = torch.zeros(10, dtype=torch.float32, device=DEVICE)
    delta = SparseDelta(
        positions=torch.tensor(positions, dtype=torch.int64, device=DEVICE),
        diffs=torch.tensor(diffs, dtype=torch.int32, device=DEVICE),
    )
    with pytest.raises(ValueError, match=error):
        triton_delta.delta_apply(old, delta)


def test_encode_refuses_mismatched_tensors():
    with pytest.raises(ValueError, match="equal shape and dtype"):
        triton_delta.delta_encode(torch.zeros(4, device=DEVICE), torch.zeros(5, device=DEVICE))
    with pytest.raises(ValueError, match="equal shape and dtype"):
        triton_delta.delta_encode(
            torch.zeros(4, device=DEVICE), torch.zeros(4, dtype=torch.float16, device=DEVICE)
        )


# Compiles every kernel variant to PTX for an sm_90 GPU; needs no GPU, only the
# compiler and ptxas that ship in the triton wheel.
COMPILE_FOR_GPU = (
    """
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rtrl.kernels import triton_delta, triton_mxfp8

def compile_ptx(kernel, signature, constexprs):
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]

ptx = []
for bits in ["*i8", "*i16", "*i32", "*i64"]:
    pair = {"old_ptr": bits, "new_ptr": bits}
    ptx.append(compile_ptx(triton_delta._count_changes, {**pair, "counts_ptr": "*i64", "numel": "i64"}, """
    """{"BLOCK": 1024}))
    ptx.append(compile_ptx(
        triton_delta._compact_changes,
        {**pair, "starts_ptr": "*i64", "positions_ptr": "*i64", "diffs_ptr": bits, "numel": "i64"},
        {"BLOCK": 1024},
    ))
    ptx.append(compile_ptx(
        triton_delta._scatter_add, """
    """{"bits_ptr": bits, "positions_ptr": "*i64", "diffs_ptr": bits, "changed": "i64"}, {"BLOCK": 1024}
    ))
for pointer, bf16 in [("*i16", True), ("*fp16", False), ("*fp32", False)]:
    ptx.append(compile_ptx(
        triton_mxfp8._quantize,
        {"x_ptr": pointer, "data_ptr": "*u8", "scales_ptr": "*u8", "blocks": "i64"},
        {"X_BF16": bf16, "ROWS": 32, "BLOCK": 32},
    ))
    ptx.append(compile_ptx(
        triton_mxfp8._dequantize,
        {"data_ptr": "*u8", "scales_ptr": "*u8", "out_ptr": pointer, "blocks": "i64"},
        {"OUT_BF16": bf16, "ROWS": 32, "BLOCK": 32},
    ))
# MXFP8 is bit-identical to the torch path only if fp32 subnormals survive a multiply.
flushing = [line for text in ptx for line in text.splitlines() if re.search(r"\\.ftz", line)]
assert not flushing, flushing
print(len(ptx))
"""
)


def test_kernels_compile_for_a_gpu(tmp_path):
    env = {
        **os.environ,
        "TRITON_INTERPRET": "0",
        "TRITON_CACHE_DIR": str(tmp_path),
        "TRITON_DEFAULT_FP_FUSION": "0",
    }
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_GPU],
        check=False,
        env=env,
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["18"]
