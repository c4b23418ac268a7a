"""Version blobs: tensors in, bytes and a manifest out, and back — pure functions.

A keyframe blob is one zstd frame per tensor (its raw bytes), located by its
TensorMeta's offset and length. A delta blob stores each tensor that kept its shape
and dtype as ``sparse_diff`` (kernels.delta against the same tensor of the parent
version) and any other tensor ``full``. The sparse tensors share two sections, so
a hundred small tensors do not pay a hundred frame headers and entropy tables:

  delta_positions  zstd of the gaps between changed positions (the first is the
                   first position), all tensors in manifest order, as uint64 byte planes
  delta_values     zstd of the bit-pattern differences, zigzag-mapped, LEB128

TensorMeta.changed says how many entries of each section belong to a tensor.
Every TensorMeta carries the xxh3_128 of the tensor's full new bytes, so decoding
proves the result is bit-identical to what the trainer published, whatever path it
took. Bytes are the host's native order (little-endian on every platform we run).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from rtrl import kernels
from rtrl.kernels import delta_cpu
from rtrl.kernels.delta import SparseDelta, bits_dtype
from rtrl.kernels.varint import (
    from_planes,
    leb128_decode,
    to_planes,
    unzigzag,
    zigzag_leb128_encode,
)
from rtrl.v1 import weights_pb2
from rtrl.weight_sync.checksum import xxh3_hex

FULL = "full"
SPARSE_DIFF = "sparse_diff"
ZSTD_LEVEL = 3

Weights = Mapping[str, torch.Tensor]
_SIGNED = {width: np.dtype(f"<i{width}") for width in (1, 2, 4, 8)}


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
    """The tensor's raw bytes (C order, on the CPU) as a uint8 array, without a copy when
    possible. Called twice per tensor per publish, so it avoids every torch call it can."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    if not tensor.is_cpu or not tensor.is_contiguous():
        tensor = tensor.cpu().contiguous()
    if tensor.dim() != 1:
        tensor = tensor.reshape(-1)
    return tensor.view(torch.uint8).numpy()


def tensor_checksum(tensor: torch.Tensor) -> str:
    return xxh3_hex(tensor_bytes(tensor).data)


def tensor_from_bytes(
    data: bytes | memoryview, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    width = torch.empty((), dtype=dtype).element_size()
    numel = int(np.prod(shape, dtype=np.int64))
    if len(data) != numel * width:
        raise DecodeError(
            f"{len(data)} bytes cannot hold a {dtype_name(dtype)} tensor of shape {list(shape)}"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    # Copied so the tensor owns writable memory instead of aliasing the blob.
    raw = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
    return raw.view(dtype).reshape(shape)


@dataclass(frozen=True)
class EncodedVersion:
    """Produced by encode (trainer side); its manifest() is what the publisher sends."""

    blob: bytes
    tensors: list[weights_pb2.TensorMeta]
    delta_positions: weights_pb2.Section | None
    delta_values: weights_pb2.Section | None

    def manifest(self, **fields) -> weights_pb2.Manifest:
        """A Manifest describing this blob; ``fields`` add arm, version, keyframe and the rest."""
        manifest = weights_pb2.Manifest(
            tensors=self.tensors,
            blob_size=len(self.blob),
            blob_checksum=xxh3_hex(self.blob),
            **fields,
        )
        if self.delta_positions is not None:
            assert self.delta_values is not None  # encode() gives both sections or neither
            manifest.delta_positions.CopyFrom(self.delta_positions)
            manifest.delta_values.CopyFrom(self.delta_values)
        return manifest


class EncodeBuffers:
    """Memory a publisher reuses for every encode: fresh buffers would cost a page
    fault per 4 KiB written, about a fifth of the encode on a MiniLM-sized delta."""

    def __init__(self) -> None:
        self.changes = delta_cpu.Changes()
        self._varints = np.empty(0, dtype=np.uint8)

    def varints(self, count: int) -> np.ndarray:
        if self._varints.size < 10 * count:
            self._varints = np.empty(max(10 * count, 2 * self._varints.size), dtype=np.uint8)
        return self._varints


def encode(
    parent: Weights | None, new: Weights, buffers: EncodeBuffers | None = None
) -> EncodedVersion:
    """A keyframe blob when ``parent`` is None, else a delta blob against it.

    Tensors absent from the parent, or whose shape or dtype changed, are stored full.
    """
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    buffers = buffers or EncodeBuffers()
    changes = buffers.changes
    changes.clear()
    sections: list[bytes] = []
    metas: list[weights_pb2.TensorMeta] = []
    offset = 0
    for name, tensor in new.items():
        raw = tensor_bytes(tensor)
        meta = weights_pb2.TensorMeta(
            name=name,
            shape=list(tensor.shape),
            dtype=dtype_name(tensor.dtype),
            checksum=xxh3_hex(raw.data),
        )
        base = None if parent is None else parent.get(name)
        if base is not None and base.shape == tensor.shape and base.dtype == tensor.dtype:
            meta.encoding, meta.changed = SPARSE_DIFF, _append_changes(changes, base, tensor, raw)
        else:
            section = compressor.compress(raw.data)
            meta.encoding, meta.offset, meta.length = FULL, offset, len(section)
            sections.append(section)
            offset += len(section)
        metas.append(meta)
    if parent is None:
        return EncodedVersion(b"".join(sections), metas, None, None)
    position_bytes = compressor.compress(to_planes(_gaps(changes)))
    value_bytes = compressor.compress(
        zigzag_leb128_encode(changes.diffs, buffers.varints(changes.count))
    )
    delta_positions = weights_pb2.Section(offset=offset, length=len(position_bytes))
    delta_values = weights_pb2.Section(offset=offset + len(position_bytes), length=len(value_bytes))
    return EncodedVersion(
        b"".join([*sections, position_bytes, value_bytes]), metas, delta_positions, delta_values
    )


def _gaps(changes: delta_cpu.Changes) -> np.ndarray:
    """Each tensor's positions as gaps: its first position, then the distance to each next one."""
    positions = changes.positions
    gaps = positions.copy()
    gaps[1:] -= positions[:-1]
    starts = np.cumsum([0, *changes.counts[:-1]])
    starts = starts[starts < len(positions)]
    gaps[starts] = positions[starts]
    return gaps


def _append_changes(
    changes: delta_cpu.Changes, base: torch.Tensor, tensor: torch.Tensor, raw: np.ndarray
) -> int:
    """Append tensor's changes against base; on the CPU straight from the numpy bytes at
    hand (torch's per-call overhead is a tenth of the work on small tensors)."""
    if tensor.is_cpu and base.is_cpu:
        bits = _SIGNED[tensor.element_size()]
        return changes.append(tensor_bytes(base).view(bits), raw.view(bits))
    # On a GPU its kernel finds the changes; only they come back to the host.
    delta = kernels.delta_encode(base.detach().to(tensor.device), tensor.detach())
    return changes.extend(delta.positions.cpu().numpy(), delta.diffs.cpu().numpy())


def verify_blob(blob: bytes, manifest: weights_pb2.Manifest) -> None:
    if len(blob) != manifest.blob_size or xxh3_hex(blob) != manifest.blob_checksum:
        raise ChecksumMismatch(
            f"blob of {manifest.arm} v{manifest.version} ({len(blob)} bytes, xxh3 {xxh3_hex(blob)}) does not match "
            f"its manifest ({manifest.blob_size} bytes, xxh3 {manifest.blob_checksum})"
        )


def decode(
    blob: bytes, manifest: weights_pb2.Manifest, parent: Weights | None
) -> dict[str, torch.Tensor]:
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
    _check_sparse_against_parent(manifest, parent)
    gaps, values = _delta_sections(view, manifest, decompressor)
    weights: dict[str, torch.Tensor] = {}
    cursor = 0
    for meta in manifest.tensors:
        if meta.encoding == FULL:
            dtype, shape = parse_dtype(meta.dtype), tuple(meta.shape)
            size = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
            payload = _decompress(
                decompressor,
                view,
                meta.offset,
                meta.length,
                size,
                f"tensor {meta.name} of {manifest.arm} v{manifest.version}",
            )
            tensor = tensor_from_bytes(payload, dtype, shape)
        elif meta.encoding == SPARSE_DIFF:
            if cursor + meta.changed > len(gaps):
                raise DecodeError(
                    f"tensor {meta.name} claims {meta.changed} changes past the {len(gaps)} in the delta sections"
                )
            tensor = _apply_sparse(
                meta,
                gaps[cursor : cursor + meta.changed],
                values[cursor : cursor + meta.changed],
                parent,
            )
            cursor += meta.changed
        else:
            raise DecodeError(f"tensor {meta.name} has unknown encoding {meta.encoding!r}")
        if tensor_checksum(tensor) != meta.checksum:
            raise ChecksumMismatch(
                f"tensor {meta.name} of {manifest.arm} v{manifest.version} decodes to xxh3 "
                f"{tensor_checksum(tensor)}, manifest says {meta.checksum}"
            )
        weights[meta.name] = tensor
    if cursor != len(gaps):
        raise DecodeError(
            f"the delta sections hold {len(gaps)} changes but the tensors claim {cursor}"
        )
    return weights


def _decompress(
    decompressor: zstandard.ZstdDecompressor,
    view: memoryview,
    offset: int,
    length: int,
    max_size: int,
    what: str,
) -> bytes:
    """A section's bytes; a frame that claims more than max_size bytes is refused before
    anything is allocated for it (a flipped bit in its header could ask for exabytes)."""
    if offset + length > len(view):
        raise DecodeError(f"{what} lies beyond the end of the blob")
    frame = view[offset : offset + length]
    try:
        size = zstandard.frame_content_size(frame)
        if not 0 <= size <= max_size:
            raise DecodeError(
                f"{what}: its zstd frame claims {size} bytes, at most {max_size} expected"
            )
        return decompressor.decompress(frame, max_output_size=max_size)
    except zstandard.ZstdError as exc:
        raise DecodeError(f"{what}: {exc}") from exc


def _check_sparse_against_parent(manifest: weights_pb2.Manifest, parent: Weights | None) -> None:
    """Every sparse tensor needs its parent tensor, and cannot change more elements than
    it has: checked before any section is decompressed, so a corrupt count allocates nothing."""
    for meta in manifest.tensors:
        if meta.encoding != SPARSE_DIFF:
            continue
        base = None if parent is None else parent.get(meta.name)
        if (
            base is None
            or list(base.shape) != list(meta.shape)
            or dtype_name(base.dtype) != meta.dtype
        ):
            raise ParentMismatch(
                f"tensor {meta.name} is a delta but the parent weights hold no "
                f"{meta.dtype}{list(meta.shape)} tensor by that name"
            )
        if meta.changed > base.numel():
            raise DecodeError(
                f"tensor {meta.name} claims {meta.changed} changes in {base.numel()} elements"
            )


def _delta_sections(
    view: memoryview, manifest: weights_pb2.Manifest, decompressor
) -> tuple[np.ndarray, np.ndarray]:
    """(gaps as int64, differences as int64) of every sparse tensor, concatenated."""
    total = sum(meta.changed for meta in manifest.tensors if meta.encoding == SPARSE_DIFF)
    if not manifest.HasField("delta_positions"):
        if total:
            raise DecodeError(
                f"{manifest.arm} v{manifest.version} has sparse tensors but no delta sections"
            )
        return np.empty(0, np.int64), np.empty(0, np.int64)
    what = f"delta sections of {manifest.arm} v{manifest.version}"
    positions = manifest.delta_positions
    value_section = manifest.delta_values
    try:
        gaps = from_planes(
            _decompress(decompressor, view, positions.offset, positions.length, 8 * total, what),
            total,
        )
        values = unzigzag(
            leb128_decode(
                _decompress(
                    decompressor, view, value_section.offset, value_section.length, 10 * total, what
                ),
                total,
            )
        )
    except ValueError as exc:
        raise DecodeError(f"{what}: {exc}") from exc
    return gaps.view(np.int64), values


def _apply_sparse(
    meta: weights_pb2.TensorMeta, gaps: np.ndarray, values: np.ndarray, parent: Weights | None
) -> torch.Tensor:
    dtype, shape = parse_dtype(meta.dtype), tuple(meta.shape)
    base = None if parent is None else parent.get(meta.name)
    if base is None or tuple(base.shape) != shape or base.dtype != dtype:
        raise ParentMismatch(
            f"tensor {meta.name} is a delta but the parent weights hold no "
            f"{meta.dtype}{list(shape)} tensor by that name"
        )
    # Differences were sign-extended from the tensor's integer width; truncating restores them exactly.
    delta = SparseDelta(
        positions=torch.from_numpy(np.cumsum(gaps)),
        diffs=torch.from_numpy(
            values.astype(np.dtype(str(bits_dtype(dtype)).removeprefix("torch.")))
        ),
    )
    try:
        return kernels.delta_apply(base.detach().cpu(), delta)
    except ValueError as exc:
        raise DecodeError(f"tensor {meta.name}: {exc}") from exc
