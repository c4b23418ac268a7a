"""MXFP8: hand-computed blocks, error bounds, and the Triton kernels against the torch path.

Under TRITON_INTERPRET=1 (the default here) the kernels run on CPU tensors; run with
TRITON_INTERPRET=0 on a machine with a GPU to hold the compiled kernels to the same cases.
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

# Must be set before triton is imported: triton.jit reads it when it decorates a kernel.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rtrl.kernels import mxfp8
from rtrl.kernels.mxfp8 import MXFP8Tensor

# Only a missing triton skips; any other import error in the kernels must fail loudly.
triton_mxfp8: ModuleType | None
if importlib.util.find_spec("triton") is None:
    triton_mxfp8 = None
else:
    from rtrl.kernels import triton_mxfp8

needs_triton = pytest.mark.skipif(
    triton_mxfp8 is None,
    reason="the Triton kernels need the gpu extra: pip install -c constraints.txt -e '.[gpu]'",
)
DEVICE = "cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda"
PATHS = [
    pytest.param(mxfp8, id="torch"),
    pytest.param(triton_mxfp8, id="triton", marks=needs_triton),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# The interpreter computes with numpy, which warns when a product or an fp16 cast
# overflows to inf or meets a NaN scale: the cases these tests make on purpose.
pytestmark = pytest.mark.filterwarnings(
    "ignore:(overflow|invalid value) encountered:RuntimeWarning"
)

E8M0_ONE = 127


def bits_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[tensor.element_size()])


def block(*values: float) -> torch.Tensor:
    """One 32-element block (as a 1x32 fp32 tensor): ``values``, then zeros."""
    row = torch.zeros((1, 32), dtype=torch.float32)
    row[0, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return row


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "x, scale_byte, element_bytes",
    [
        # amax exactly 1.0 = 2**0: scale 2**(0 - 8), so 1.0 becomes 256 (0x78) and 0.5 128 (0x70).
        (block(1.0, 0.5, -0.25), E8M0_ONE - 8, [0x78, 0x70, 0xE8]),
        # amax 256: scale 2**0, elements are their own E4M3 roundings; 17 ties to even 16 (0x58), 19 to 20 (0x5A).
        (block(256.0, 17.0, 19.0, -448.0 / 2), E8M0_ONE, [0x78, 0x58, 0x5A, 0xF6]),
        # amax 1.9375 = 31/16: floor(log2) is 0, 1.9375 * 256 = 496 saturates to 448 (0x7E), and so does -1.9.
        (block(1.9375, -1.9), E8M0_ONE - 8, [0x7E, 0xFE]),
        # 2**-7 after scaling is subnormal 4 * 2**-9; 1.5 * 2**-9 ties to even 2 * 2**-9; 2**-10 ties to 0; signs stay.
        (
            block(1.0, 2.0**-15, 3 * 2.0**-18, 2.0**-18, -(2.0**-18)),
            E8M0_ONE - 8,
            [0x78, 0x04, 0x02, 0x00, 0x80],
        ),
        # A carry out of the mantissa moves into the exponent: 15.9 rounds to 16.
        (block(256.0, 15.9), E8M0_ONE, [0x78, 0x58]),
        # All zeros: the smallest scale, 2**-127 (byte 0); -0.0 keeps its sign.
        (block(0.0, -0.0), 0, [0x00, 0x80]),
        # fp32 subnormal amax 2**-130: the scale clamps at 2**-127, so it is stored as 2**-3 (0x20).
        (block(2.0**-130), 0, [0x20]),
        # Largest finite fp32: floor(log2) is 127, scale 2**119, element 1.99.. * 2**8 saturates.
        (block(torch.finfo(torch.float32).max), E8M0_ONE + 119, [0x7E]),
        # Any NaN or Inf makes the whole block NaN: scale 255 and every element 0x7F.
        (block(1.0, float("nan")), 255, [0x7F] * 32),
        (block(float("-inf"), 1.0), 255, [0x7F] * 32),
    ],
)
def test_hand_computed_blocks(path, x, scale_byte, element_bytes):
    quantized = path.mxfp8_quantize(x.to(DEVICE))
    assert quantized.scales.tolist() == [[scale_byte]]
    data = bits_of(quantized.data).reshape(-1).tolist()
    assert data[: len(element_bytes)] == element_bytes
    assert all(byte == 0x00 for byte in data[len(element_bytes) :])


@pytest.mark.parametrize("path", PATHS)
def test_blocks_are_independent(path):
    x = torch.cat([block(1.0, float("nan")), block(256.0, 17.0), block(0.0)], dim=1)
    data, scales = path.mxfp8_quantize(x.to(DEVICE))
    assert scales.tolist() == [[255, E8M0_ONE, 0]]
    assert bits_of(data)[0, 32:34].tolist() == [0x78, 0x58]
    decoded = path.mxfp8_dequantize(data, scales, torch.float32)
    assert decoded[0, :32].isnan().all()
    assert decoded[0, 32:34].tolist() == [256.0, 16.0] and not decoded[0, 34:].any()


def test_rounding_of_every_bf16_and_fp16_value_matches_torch_cast():
    # Every value within ±448 (beyond, all saturate). Each block holds 448, so its scale
    # is 2**0 and the E4M3 rounding is seen directly.
    bf16 = (
        torch.arange(-(2**15), 2**15, dtype=torch.int32)
        .to(torch.int16)
        .view(torch.bfloat16)
        .float()
    )
    fp16 = (
        torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    )
    generator = torch.Generator().manual_seed(0)
    fp32 = torch.randint(
        -(2**31), 2**31 - 1, (2**15,), generator=generator, dtype=torch.int32
    ).view(torch.float32)
    values = torch.cat([bf16, fp16, fp32])
    values = values[values.abs() <= 448.0]
    values = values[: values.numel() // 31 * 31].reshape(-1, 31)
    x = torch.cat([torch.full((values.shape[0], 1), 448.0), values], dim=1)
    want = x.to(torch.float8_e4m3fn)
    for path in (mxfp8, triton_mxfp8):
        if path is None:
            continue
        quantized = path.mxfp8_quantize(x.to(DEVICE))
        assert (quantized.scales == E8M0_ONE).all()
        assert torch.equal(bits_of(quantized.data).cpu(), bits_of(want)), path.__name__


def assert_within_e4m3_step(x: torch.Tensor, quantized: MXFP8Tensor) -> None:
    """Each element is off by at most half an E4M3 step at its scale (or saturated to 448)."""
    decoded = mxfp8.mxfp8_dequantize(quantized.data, quantized.scales, torch.float32).float()
    scale = mxfp8.e8m0_to_float32(quantized.scales).repeat_interleave(32, dim=-1)
    target = torch.maximum(torch.minimum(x.float(), 448 * scale), -448 * scale)
    # Half a step: 2**-4 of the value for normals, 2**-10 of the scale below 2**-6.
    bound = torch.maximum(target.abs() * 2.0**-4, scale * 2.0**-10)
    assert ((decoded - target).abs() <= bound).all()
    # Only elements above the block's largest E4M3 value saturate.
    saturated = x.float().abs() > 448 * scale
    assert (x.float().abs()[saturated] < 512 * scale[saturated]).all()


def random_input(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Finite normal values whose blocks span many binades (down into ``dtype``'s
    subnormals), with some +0.0 and -0.0 mixed in."""
    generator = torch.Generator().manual_seed(seed)
    low, high = (-20, 12) if dtype == torch.float16 else (-135, 120)
    block_binades = torch.randint(low, high, (*shape[:-1], shape[-1] // 32, 1), generator=generator)
    block_scales = torch.exp2(block_binades.float()).repeat_interleave(32, dim=-1).reshape(shape)
    x = torch.randn(shape, generator=generator) * block_scales
    x[torch.rand(shape, generator=generator) < 0.05] = 0.0
    x[torch.rand(shape, generator=generator) < 0.05] = -0.0
    return x.to(dtype)


@needs_triton
@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    leading=st.lists(st.integers(1, 5), max_size=2),
    blocks=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
)
def test_triton_matches_torch_bit_for_bit(dtype, leading, blocks, seed):
    assert triton_mxfp8 is not None  # needs_triton
    x = random_input((*leading, 32 * blocks), dtype, seed).to(DEVICE)
    want = mxfp8.mxfp8_quantize(x)
    got = triton_mxfp8.mxfp8_quantize(x)
    assert got.data.shape == x.shape and got.scales.shape == (*leading, blocks)
    assert torch.equal(bits_of(got.data), bits_of(want.data))
    assert torch.equal(got.scales, want.scales)
    assert_within_e4m3_step(x, want)
    for out_dtype in DTYPES:
        expected = mxfp8.mxfp8_dequantize(want.data, want.scales, out_dtype)
        decoded = triton_mxfp8.mxfp8_dequantize(want.data, want.scales, out_dtype)
        assert decoded.dtype == out_dtype and torch.equal(bits_of(decoded), bits_of(expected))


@needs_triton
@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
def test_dequantize_every_byte_and_scale(out_dtype):
    # All 256 element bytes under every scale byte, including 0 (2**-127) and 255 (NaN).
    assert triton_mxfp8 is not None  # needs_triton
    data = (
        torch.arange(256, dtype=torch.int32)
        .to(torch.uint8)
        .repeat(256)
        .view(torch.float8_e4m3fn)
        .reshape(256 * 8, 32)
    )
    scales = (
        torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat_interleave(8).reshape(-1, 1)
    )
    data, scales = data.to(DEVICE), scales.to(DEVICE)
    want = mxfp8.mxfp8_dequantize(data, scales, out_dtype)
    got = triton_mxfp8.mxfp8_dequantize(data, scales, out_dtype)
    # NaN bit patterns differ between devices even in torch; everything else must match exactly.
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(bits_of(got)[~nan], bits_of(want)[~nan])
    # 0x7F and 0xFF under each of the 255 finite scales, and the whole NaN-scale block.
    assert nan.sum() == 2 * 255 + 256


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", [(0, 32), (3, 0), (2, 0, 64)])
def test_empty_tensors(path, shape):
    data, scales = path.mxfp8_quantize(torch.zeros(shape, device=DEVICE))
    assert data.shape == shape and scales.shape == (*shape[:-1], shape[-1] // 32)
    assert path.mxfp8_dequantize(data, scales).shape == shape


@pytest.mark.parametrize("path", PATHS)
def test_non_contiguous_input(path):
    x = random_input((64, 96), torch.float32, seed=3).t().to(DEVICE)
    assert torch.equal(
        bits_of(path.mxfp8_quantize(x).data), bits_of(mxfp8.mxfp8_quantize(x.contiguous()).data)
    )


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "make, error",
    [
        # The last dimension must split into whole blocks.
        (lambda: torch.zeros(4, 33), "multiple of 32"),
        (lambda: torch.tensor(1.0), "multiple of 32"),
        (lambda: torch.zeros(32, dtype=torch.float64), "float32, bfloat16 or float16"),
    ],
)
def test_quantize_refuses(path, make, error):
    with pytest.raises(ValueError, match=error):
        path.mxfp8_quantize(make().to(DEVICE))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "data, scales, dtype, error",
    [
        (
            torch.zeros(2, 64),
            torch.zeros(2, 2, dtype=torch.uint8),
            torch.bfloat16,
            "float8_e4m3fn data",
        ),
        (
            torch.zeros(2, 64, dtype=torch.float8_e4m3fn),
            torch.zeros(2, 1, dtype=torch.uint8),
            torch.bfloat16,
            "scales of shape",
        ),
        (
            torch.zeros(2, 64, dtype=torch.float8_e4m3fn),
            torch.zeros(2, 2, dtype=torch.int8),
            torch.bfloat16,
            "uint8 scales",
        ),
        (
            torch.zeros(2, 64, dtype=torch.float8_e4m3fn),
            torch.zeros(2, 2, dtype=torch.uint8),
            torch.float64,
            "dequantizes to",
        ),
    ],
)
def test_dequantize_refuses(path, data, scales, dtype, error):
    with pytest.raises(ValueError, match=error):
        path.mxfp8_dequantize(data.to(DEVICE), scales.to(DEVICE), dtype)
