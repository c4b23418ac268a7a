"""MXFP8 (OCP Microscaling v1.0, E4M3 elements): the portable torch path.

Every 32 consecutive elements along the last dimension share one power-of-two scale
stored as an E8M0 byte. Quantizing a block, following section 6.3 of the spec:

- ``amax`` is the largest magnitude in the block (read from the fp32 bit pattern, so a
  NaN is never lost to a comparison);
- the shared exponent is ``floor(log2(amax)) - 8`` (8 is E4M3's largest exponent), so
  ``amax / scale`` lands in [256, 512) and only the top of that range saturates;
- it is clamped below at -127, the smallest E8M0 scale: an all-zero block and blocks
  whose amax is below 2**-118 get scale byte 0 (2**-127);
- each element is multiplied by ``2**-shared_exponent`` in fp32 (exact unless it falls
  below fp32's normal range, where it is far below E4M3's smallest subnormal anyway),
  clamped to ±448 and rounded to the nearest E4M3 value, ties to even, by torch's
  float8_e4m3fn cast. Signs survive: -0.0 and negative values that round to zero give
  the byte 0x80.

A block holding a NaN or ±Inf has no meaningful scale (and E4M3 has no Inf): its scale
byte is 255 (E8M0's NaN) and every element byte is 0x7F (E4M3's NaN), so the whole block
dequantizes to NaN. Other blocks are unaffected.

Dequantizing multiplies each E4M3 value by its block's scale in fp32, which is exact
(at most 4 significant bits, and 2**-136 is still an fp32 subnormal), then casts to the
requested dtype with round-to-nearest-even.

kernels.triton_mxfp8 computes the same bytes with fused Triton kernels, rounding with
integer arithmetic that the tests hold to torch's cast on every bf16 and fp16 value.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

BLOCK_SIZE = 32
"""Elements per shared scale (the spec's k)."""
E4M3_EMAX = 8
"""Exponent of E4M3's largest power of two (448 = 1.75 * 2**8)."""
E4M3_MAX = 448.0
E8M0_BIAS = 127
E8M0_NAN = 255
E4M3_NAN = 0x7F
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUTPUT_DTYPES = INPUT_DTYPES


@dataclass(frozen=True)
class MXFP8Tensor:
    """Produced by mxfp8_quantize; consumed by mxfp8_dequantize (unpacks as ``data, scales``)."""

    data: torch.Tensor
    """float8_e4m3fn, the input's shape: each element divided by its block's scale."""
    scales: torch.Tensor
    """uint8 E8M0 (2**(byte - 127), 255 is NaN), shape ``(..., K // 32)``."""

    def __post_init__(self) -> None:
        check_quantized(self.data, self.scales)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter((self.data, self.scales))


def _check_blocked_shape(shape: torch.Size) -> None:
    if len(shape) == 0 or shape[-1] % BLOCK_SIZE:
        raise ValueError(
            f"MXFP8 needs a last dimension that is a multiple of {BLOCK_SIZE}, got shape {tuple(shape)}"
        )


def check_input(x: torch.Tensor) -> None:
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(f"MXFP8 quantizes float32, bfloat16 or float16, got {x.dtype}")
    _check_blocked_shape(x.shape)


def check_quantized(data: torch.Tensor, scales: torch.Tensor) -> None:
    if data.dtype != torch.float8_e4m3fn or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP8 needs float8_e4m3fn data and uint8 scales, got {data.dtype} and {scales.dtype}"
        )
    _check_blocked_shape(data.shape)
    expected = (*data.shape[:-1], data.shape[-1] // BLOCK_SIZE)
    if tuple(scales.shape) != expected:
        raise ValueError(
            f"MXFP8 data of shape {tuple(data.shape)} needs scales of shape {expected}, got {tuple(scales.shape)}"
        )


def check_output_dtype(dtype: torch.dtype) -> None:
    if dtype not in OUTPUT_DTYPES:
        raise ValueError(f"MXFP8 dequantizes to float32, bfloat16 or float16, got {dtype}")


def mxfp8_quantize(x: torch.Tensor) -> MXFP8Tensor:
    """Quantize ``x`` (fp32/bf16/fp16, last dimension a multiple of 32) block by block."""
    check_input(x)
    blocks = x.reshape(-1, BLOCK_SIZE).to(torch.float32)
    magnitude_bits = blocks.view(torch.int32) & 0x7FFFFFFF
    # Magnitudes order like their bit patterns, and NaN patterns sit above +Inf.
    amax_bits = magnitude_bits.amax(dim=1, keepdim=True)
    non_finite = amax_bits >= 0x7F800000
    # The biased exponent field is floor(log2) + 127 for normals; fp32 subnormals read
    # as -127, lower than the truth, but clamp to the same scale either way.
    shared_exponent = ((amax_bits >> 23) - 127 - E4M3_EMAX).clamp(min=-E8M0_BIAS)
    # 2**-shared_exponent lies in [2**-119, 2**127], always a normal fp32.
    inverse_scale = ((E8M0_BIAS - shared_exponent) << 23).view(torch.float32)
    scaled = (blocks * inverse_scale).clamp(-E4M3_MAX, E4M3_MAX)
    element_bytes = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    element_bytes = torch.where(non_finite, E4M3_NAN, element_bytes)
    scale_bytes = torch.where(non_finite, E8M0_NAN, shared_exponent + E8M0_BIAS).to(torch.uint8)
    return MXFP8Tensor(
        data=element_bytes.view(torch.float8_e4m3fn).reshape(x.shape),
        scales=scale_bytes.reshape(*x.shape[:-1], x.shape[-1] // BLOCK_SIZE),
    )


def e8m0_to_float32(scales: torch.Tensor) -> torch.Tensor:
    """The fp32 value of each E8M0 byte: 2**(byte - 127), NaN for 255."""
    exponent = scales.to(torch.int32)
    # Byte 0 is 2**-127, an fp32 subnormal whose bit pattern is the mantissa's top bit.
    bits = torch.where(exponent == 0, 1 << 22, exponent << 23)
    return torch.where(exponent == E8M0_NAN, torch.nan, bits.view(torch.float32))


def mxfp8_dequantize(
    data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """The values ``data`` and ``scales`` stand for, as ``dtype`` (fp32/bf16/fp16)."""
    check_quantized(data, scales)
    check_output_dtype(dtype)
    blocks = data.reshape(-1, BLOCK_SIZE).to(torch.float32)
    values = blocks * e8m0_to_float32(scales.reshape(-1, 1))
    return values.to(dtype).reshape(data.shape)
