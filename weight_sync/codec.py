"""Version blobs: tensors in, bytes and TensorMeta out, and back — pure functions.

A blob is the concatenation of one zstd frame per tensor, each located by its
TensorMeta (offset, length). A tensor's section is either ``full`` (its raw bytes)
or ``xor_gap`` (kernels.delta against the same tensor of the parent version:
int64 gaps, then the XOR words). Every TensorMeta carries the xxh3_128 of the
tensor's full new bytes, so decoding proves the result is bit-identical to what
the trainer published, whatever path it took. Bytes are the host's native order
(little-endian on every platform we run).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
import zstandard

from kernels.delta import SparseXorDelta, bits_dtype, delta_apply, delta_encode
from rtrl.v1 import weights_pb2
from weight_sync.checksum import xxh3_hex

FULL = "full"
XOR_GAP = "xor_gap"
ZSTD_LEVEL = 3

Weights = Mapping[str, torch.Tensor]


class DecodeError(Exception):
    """A blob that cannot become the weights its manifest describes; it must not be applied."""


class ChecksumMismatch(DecodeError):
    """The blob, or a tensor rebuilt from it, does not hash to the manifest's checksum."""


class ParentMismatch(DecodeError):
    """A delta was applied to weights that are not its parent version."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise DecodeError(f"unknown dtype {name!r}")
    return dtype


def tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's raw bytes (C order, on the CPU) as a uint8 array, without a copy when possible."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def tensor_checksum(tensor: torch.Tensor) -> str:
    return xxh3_hex(tensor_bytes(tensor))


def tensor_from_bytes(data: bytes | memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    width = torch.empty((), dtype=dtype).element_size()
    numel = int(np.prod(shape, dtype=np.int64))
    if len(data) != numel * width:
        raise DecodeError(f"{len(data)} bytes cannot hold a {dtype_name(dtype)} tensor of shape {list(shape)}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    # Copied so the tensor owns writable memory instead of aliasing the blob.
    raw = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
    return raw.view(dtype).reshape(shape)


def encode(parent: Weights | None, new: Weights) -> tuple[bytes, list[weights_pb2.TensorMeta]]:
    """A keyframe blob when ``parent`` is None, else a delta blob against it.

    Tensors absent from the parent, or whose shape or dtype changed, are stored full.
    """
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    sections: list[bytes] = []
    metas: list[weights_pb2.TensorMeta] = []
    offset = 0
    for name, tensor in new.items():
        tensor = tensor.detach()
        raw = tensor_bytes(tensor)
        base = None if parent is None else parent.get(name)
        if base is not None and base.shape == tensor.shape and base.dtype == tensor.dtype:
            delta = delta_encode(base.detach().to(tensor.device), tensor)
            payload = tensor_bytes(delta.gaps).tobytes() + tensor_bytes(delta.xor).tobytes()
            encoding = XOR_GAP
        else:
            payload, encoding = raw, FULL
        section = compressor.compress(payload)
        metas.append(
            weights_pb2.TensorMeta(
                name=name,
                shape=list(tensor.shape),
                dtype=dtype_name(tensor.dtype),
                checksum=xxh3_hex(raw),
                encoding=encoding,
                offset=offset,
                length=len(section),
            )
        )
        sections.append(section)
        offset += len(section)
    return b"".join(sections), metas


def verify_blob(blob: bytes, manifest: weights_pb2.Manifest) -> None:
    if len(blob) != manifest.blob_size or xxh3_hex(blob) != manifest.blob_checksum:
        raise ChecksumMismatch(
            f"blob of {manifest.arm} v{manifest.version} ({len(blob)} bytes, xxh3 {xxh3_hex(blob)}) does not match "
            f"its manifest ({manifest.blob_size} bytes, xxh3 {manifest.blob_checksum})"
        )


def decode(blob: bytes, manifest: weights_pb2.Manifest, parent: Weights | None) -> dict[str, torch.Tensor]:
    """The full weights of ``manifest``'s version, every checksum verified.

    ``parent`` must be the weights of manifest.parent_version for a delta; it is
    ignored for a keyframe and never modified. Raises a DecodeError (ChecksumMismatch
    when bytes disagree with a checksum) rather than return anything unverified.
    """
    verify_blob(blob, manifest)
    if manifest.keyframe:
        parent = None
    view = memoryview(blob)
    decompressor = zstandard.ZstdDecompressor()
    weights: dict[str, torch.Tensor] = {}
    for meta in manifest.tensors:
        if meta.offset + meta.length > len(blob):
            raise DecodeError(f"tensor {meta.name} lies beyond the end of the blob")
        try:
            payload = decompressor.decompress(view[meta.offset : meta.offset + meta.length])
        except zstandard.ZstdError as exc:
            raise DecodeError(f"tensor {meta.name} of {manifest.arm} v{manifest.version}: {exc}") from exc
        tensor = _decode_tensor(meta, payload, parent)
        if tensor_checksum(tensor) != meta.checksum:
            raise ChecksumMismatch(
                f"tensor {meta.name} of {manifest.arm} v{manifest.version} decodes to xxh3 "
                f"{tensor_checksum(tensor)}, manifest says {meta.checksum}"
            )
        weights[meta.name] = tensor
    return weights


def _decode_tensor(meta: weights_pb2.TensorMeta, payload: bytes, parent: Weights | None) -> torch.Tensor:
    dtype, shape = parse_dtype(meta.dtype), tuple(meta.shape)
    if meta.encoding == FULL:
        return tensor_from_bytes(payload, dtype, shape)
    if meta.encoding != XOR_GAP:
        raise DecodeError(f"tensor {meta.name} has unknown encoding {meta.encoding!r}")
    base = None if parent is None else parent.get(meta.name)
    if base is None or tuple(base.shape) != shape or base.dtype != dtype:
        raise ParentMismatch(f"tensor {meta.name} is a delta but the parent weights hold no {meta.dtype}{list(shape)} tensor by that name")
    bits = bits_dtype(dtype)
    word = torch.empty((), dtype=bits).element_size()
    changed, rest = divmod(len(payload), 8 + word)
    if rest:
        raise DecodeError(f"tensor {meta.name}: {len(payload)} delta bytes is not a whole number of entries")
    gaps = tensor_from_bytes(payload[: 8 * changed], torch.int64, (changed,))
    xor = tensor_from_bytes(payload[8 * changed :], bits, (changed,))
    try:
        return delta_apply(base.detach().cpu(), SparseXorDelta(gaps=gaps, xor=xor))
    except ValueError as exc:
        raise DecodeError(f"tensor {meta.name}: {exc}") from exc
