"""MXFP8 quantize and dequantize as fused Triton kernels: the GPU path of kernels.mxfp8.

One program handles ROWS blocks of 32 elements in one pass: load, amax, shared
exponent, scale, round, store bytes and scale. The output bytes are identical to
kernels.mxfp8's; see that module for the rounding and NaN/Inf rules.

The E4M3 rounding is integer bit manipulation on the fp32 pattern rather than a cast
to tl.float8e4nv, because Triton's interpreter (the CPU mode the tests run in) does not
round that cast correctly: it rounds half up and drops the carry when the mantissa
overflows, so 127.99 becomes 64. For the same reason bf16 is read and written as int16
bit patterns (the interpreter truncates fp32 -> bf16). Integer ops behave the same under
the interpreter and on a GPU, so the tested path is the shipped path.

Dequantized NaNs are the positive quiet NaN here; the torch path's NaN bit pattern
depends on the device (0xFFFF in bf16 on CPU), so only NaN positions are compared.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rtrl.kernels.mxfp8 import (
    BLOCK_SIZE,
    MXFP8Tensor,
    check_input,
    check_output_dtype,
    check_quantized,
)

ROWS = 32
"""Blocks of 32 elements per program."""


@triton.jit
def _e4m3_bits(scaled):
    """E4M3 byte (as int32) nearest to ``scaled`` (finite fp32, |scaled| <= 448), ties to even."""
    bits = scaled.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    exponent = (magnitude >> 23) - 127
    # Normal range: drop 20 of 23 mantissa bits; a carry runs into the exponent, which
    # is then rebiased from 127 to 7 (120 << 3 in the byte's exponent field).
    normal = ((magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20) - (120 << 3)
    # Below 2**-6 the byte is round(|scaled| * 2**9): the 24-bit significand shifted right.
    # Shifts past 25 leave nothing (the significand is < 2**24) and would overflow the mask.
    significand = (magnitude & 0x7FFFFF) | 0x800000
    shift = tl.minimum(14 - exponent, 25)
    quotient = significand >> shift
    remainder = significand & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    round_up = (remainder > half) | ((remainder == half) & ((quotient & 1) == 1))
    subnormal = quotient + round_up.to(tl.int32)
    return sign | tl.where(exponent >= -6, normal, subnormal)


@triton.jit
def _quantize(
    x_ptr,
    data_ptr,
    scales_ptr,
    blocks,
    X_BF16: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offsets = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    in_range = rows < blocks
    if X_BF16:
        # bf16 is the top half of an fp32; the sign-extended high bits shift out.
        bits = tl.load(x_ptr + offsets, mask=in_range[:, None], other=0).to(tl.int32) << 16
        x = bits.to(tl.float32, bitcast=True)
    else:
        x = tl.load(x_ptr + offsets, mask=in_range[:, None], other=0.0).to(tl.float32)
        bits = x.to(tl.int32, bitcast=True)
    # Magnitudes order like their bit patterns, and NaN patterns sit above +Inf.
    amax_bits = tl.max(bits & 0x7FFFFFFF, axis=1)
    non_finite = amax_bits >= 0x7F800000
    shared_exponent = tl.maximum((amax_bits >> 23) - (127 + 8), -127)
    inverse_scale = ((127 - shared_exponent) << 23).to(tl.float32, bitcast=True)
    scaled = tl.minimum(tl.maximum(x * inverse_scale[:, None], -448.0), 448.0)
    element_bytes = tl.where(non_finite[:, None], 0x7F, _e4m3_bits(scaled))
    tl.store(data_ptr + offsets, element_bytes.to(tl.uint8), mask=in_range[:, None])
    scale_bytes = tl.where(non_finite, 255, shared_exponent + 127)
    tl.store(scales_ptr + rows, scale_bytes.to(tl.uint8), mask=in_range)


@triton.jit
def _dequantize(
    data_ptr,
    scales_ptr,
    out_ptr,
    blocks,
    OUT_BF16: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offsets = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    in_range = rows < blocks
    element = tl.load(data_ptr + offsets, mask=in_range[:, None], other=0).to(tl.int32)
    magnitude = element & 0x7F
    exponent = magnitude >> 3
    mantissa = magnitude & 7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125  # 2**-9, exact
    value = tl.where(exponent == 0, subnormal, normal)
    # The sign goes on as a bit: negating would turn -0.0 into +0.0.
    value = (value.to(tl.int32, bitcast=True) | ((element & 0x80) << 24)).to(
        tl.float32, bitcast=True
    )

    scale_byte = tl.load(scales_ptr + rows, mask=in_range, other=127).to(tl.int32)
    # Byte 0 is 2**-127, an fp32 subnormal whose bit pattern is the mantissa's top bit.
    scale = tl.where(scale_byte == 0, 1 << 22, scale_byte << 23).to(tl.float32, bitcast=True)
    is_nan = (magnitude == 0x7F) | (scale_byte == 255)[:, None]
    # Exact: at most 4 significant bits, and the smallest product 2**-136 is an fp32 subnormal.
    product = value * scale[:, None]
    if OUT_BF16:
        bits = product.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(
            out_ptr + offsets,
            tl.where(is_nan, 0x7FC0, rounded).to(tl.int16),
            mask=in_range[:, None],
        )
    else:
        nan = tl.full(product.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
        tl.store(out_ptr + offsets, tl.where(is_nan, nan, product), mask=in_range[:, None])


def mxfp8_quantize(x: torch.Tensor) -> MXFP8Tensor:
    """Quantize ``x`` (fp32/bf16/fp16, last dimension a multiple of 32) block by block."""
    check_input(x)
    flat = x.contiguous().reshape(-1)
    blocks = flat.numel() // BLOCK_SIZE
    data = torch.empty(flat.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty(blocks, dtype=torch.uint8, device=x.device)
    if blocks:
        x_bf16 = x.dtype == torch.bfloat16
        source = flat.view(torch.int16) if x_bf16 else flat
        grid = (triton.cdiv(blocks, ROWS),)
        _quantize[grid](source, data, scales, blocks, X_BF16=x_bf16, ROWS=ROWS, BLOCK=BLOCK_SIZE)
    return MXFP8Tensor(
        data=data.view(torch.float8_e4m3fn).reshape(x.shape),
        scales=scales.reshape(*x.shape[:-1], x.shape[-1] // BLOCK_SIZE),
    )


def mxfp8_dequantize(
    data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """The values ``data`` and ``scales`` stand for, as ``dtype`` (fp32/bf16/fp16)."""
    check_quantized(data, scales)
    check_output_dtype(dtype)
    out = torch.empty(data.shape, dtype=dtype, device=data.device)
    blocks = data.numel() // BLOCK_SIZE
    if blocks:
        out_bf16 = dtype == torch.bfloat16
        target = out.view(torch.int16) if out_bf16 else out
        grid = (triton.cdiv(blocks, ROWS),)
        _dequantize[grid](
            data.contiguous().view(torch.uint8),
            scales.contiguous(),
            target,
            blocks,
            OUT_BF16=out_bf16,
            ROWS=ROWS,
            BLOCK=BLOCK_SIZE,
        )
    return out
