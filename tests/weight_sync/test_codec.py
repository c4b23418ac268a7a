"""The delta kernel, the version codec and the lineage rules: pure functions, no services."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rtrl import kernels
from rtrl.kernels import delta as torch_path
from rtrl.kernels import delta_cpu
from rtrl.kernels.delta import SparseDelta, bits_dtype
from rtrl.v1 import weights_pb2
from rtrl.weight_sync import codec, lineage
from rtrl.weight_sync.checksum import xxh3_hex


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(bits_dtype(tensor.dtype))


def assert_bit_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert torch.equal(bits(got[name]), bits(want[name])), name


def manifest_for(
    encoded: codec.EncodedVersion, *, keyframe: bool, version: int = 1
) -> weights_pb2.Manifest:
    return encoded.manifest(
        arm="treatment",
        version=version,
        parent_version=-1 if keyframe else version - 1,
        keyframe=keyframe,
    )


def _random(shape, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype)


def _perturb(tensor: torch.Tensor, flat_positions) -> torch.Tensor:
    out = tensor.clone().reshape(-1)
    for position in flat_positions:
        out[position] = out[position] * 1.5 + 0.25
    return out.reshape(tensor.shape)


def _flip_low_bits(tensor: torch.Tensor) -> torch.Tensor:
    out = tensor.clone()
    bits(out).bitwise_xor_(1)
    return out


def _special_bits(dtype):
    # Changes a value-comparison would miss: -0.0 vs 0.0, a NaN that stays NaN with another payload.
    old = torch.tensor([0.0, 1.0, math.nan, 2.0], dtype=dtype)
    new = old.clone()
    new[0] = -0.0
    new_bits = bits(new)
    new_bits[2] ^= 1
    return old, new


# Each case: (old, new) for one tensor, and how many elements the delta must name.
CASES = {
    "no change": lambda dt: (_random((16, 8), dt), _random((16, 8), dt), 0),
    "all changed": lambda dt: (_random((16, 8), dt), _flip_low_bits(_random((16, 8), dt)), 128),
    "sparse change": lambda dt: (
        _random((64, 32), dt),
        _perturb(_random((64, 32), dt), [0, 7, 500, 2047]),
        4,
    ),
    "0-d tensor changed": lambda dt: (torch.tensor(1.0, dtype=dt), torch.tensor(-3.0, dtype=dt), 1),
    "0-d tensor same": lambda dt: (torch.tensor(1.0, dtype=dt), torch.tensor(1.0, dtype=dt), 0),
    "1-element tensor": lambda dt: (
        torch.tensor([1.0], dtype=dt),
        torch.tensor([2.0], dtype=dt),
        1,
    ),
    "empty tensor": lambda dt: (torch.empty((0, 4), dtype=dt), torch.empty((0, 4), dtype=dt), 0),
    "signed zero and NaN payload": lambda dt: (*_special_bits(dt), 2),
    "last element only": lambda dt: (_random((3, 5), dt), _perturb(_random((3, 5), dt), [14]), 1),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


PATHS = {"torch": torch_path, "cpu": delta_cpu, "dispatch": kernels}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_delta_kernel_round_trips_bit_exact(case, dtype, path):
    old, new, changed = CASES[case](dtype)
    delta = PATHS[path].delta_encode(old, new)
    assert delta.changed == changed
    assert delta.positions.dtype == torch.int64 and delta.diffs.dtype == bits_dtype(dtype)
    before = old.clone()
    out = PATHS[path].delta_apply(old, delta)
    assert out.shape == new.shape and out.dtype == new.dtype
    assert torch.equal(bits(out), bits(new))
    assert torch.equal(bits(old), bits(before))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_codec_round_trips_bit_exact(case, dtype):
    old, new, _ = CASES[case](dtype)
    parent, weights = (
        {"w": old, "bias": torch.zeros(3, dtype=dtype)},
        {"w": new, "bias": torch.zeros(3, dtype=dtype)},
    )
    encoded = codec.encode(parent, weights)
    assert [t.encoding for t in encoded.tensors] == [codec.SPARSE_DIFF, codec.SPARSE_DIFF]
    assert_bit_identical(
        codec.decode(encoded.blob, manifest_for(encoded, keyframe=False), parent), weights
    )

    encoded = codec.encode(None, weights)
    assert [t.encoding for t in encoded.tensors] == [codec.FULL, codec.FULL]
    assert_bit_identical(
        codec.decode(encoded.blob, manifest_for(encoded, keyframe=True), None), weights
    )


def test_positions_and_wrapping_differences():
    old = torch.zeros(20)
    new = old.clone()
    new[[3, 10, 11, 19]] = 1.0
    new_bits = bits(new)
    delta = delta_cpu.delta_encode(old, new)
    assert delta.positions.tolist() == [3, 10, 11, 19]
    assert (delta.diffs == bits(torch.tensor(1.0))).all()
    # One unit in the last place either way is ±1 whatever the carries; wrapping covers sign flips.
    old16 = torch.tensor([1.0, 1.0, 0.0, -0.0], dtype=torch.bfloat16)
    new16 = bits(old16).clone()
    new16 += torch.tensor([1, -1, -32768, -32768], dtype=torch.int16)
    new16 = new16.view(torch.bfloat16)
    assert delta_cpu.delta_encode(old16, new16).diffs.tolist() == [1, -1, -32768, -32768]
    assert torch.equal(
        bits(new16), bits(delta_cpu.delta_apply(old16, delta_cpu.delta_encode(old16, new16)))
    )
    assert new_bits.numel() == 20


@pytest.mark.parametrize("path", PATHS)
def test_apply_refuses_positions_out_of_order_or_range(path):
    old = torch.zeros(4)
    diffs = torch.ones(2, dtype=torch.int32)
    for positions in ([1, 1], [2, 1], [-1, 2], [2, 4]):
        with pytest.raises(ValueError):
            PATHS[path].delta_apply(
                old, SparseDelta(positions=torch.tensor(positions), diffs=diffs)
            )
    with pytest.raises(ValueError, match="malformed"):
        PATHS[path].delta_apply(
            old, SparseDelta(positions=torch.tensor([1]), diffs=torch.ones(1, dtype=torch.int16))
        )


WIDTHS = [torch.int8, torch.float8_e4m3fn, torch.float16, torch.float32, torch.float64, torch.int64]


@settings(max_examples=60, deadline=None)
@given(
    numel=st.integers(0, 200),
    offset=st.integers(0, 7),
    positions=st.sets(st.integers(0, 199), max_size=60),
    dtype=st.sampled_from(WIDTHS),
    seed=st.integers(0, 2**16),
)
def test_cpu_path_equals_torch_path(numel, offset, positions, dtype, seed):
    # offset slices the storage so the fused path also sees tensors that are not 8-byte aligned.
    generator = torch.Generator().manual_seed(seed)
    storage = torch.randint(-100, 100, (numel + offset,), generator=generator).to(dtype)
    old = storage[offset:]
    new_bits = bits(old).clone()
    for p in sorted(p for p in positions if p < numel):
        new_bits[p] += int(torch.randint(1, 50, (), generator=generator))
    new = new_bits.view(dtype)
    want, got = torch_path.delta_encode(old, new), delta_cpu.delta_encode(old, new)
    assert torch.equal(want.positions, got.positions) and torch.equal(want.diffs, got.diffs)
    assert torch.equal(
        bits(delta_cpu.delta_apply(old, got)), bits(torch_path.delta_apply(old, want))
    )
    assert torch.equal(bits(delta_cpu.delta_apply(old, got)), new_bits)


@settings(max_examples=50, deadline=None)
@given(
    numel=st.integers(1, 300),
    positions=st.sets(st.integers(0, 299), max_size=40),
    dtype=st.sampled_from(DTYPES),
)
def test_delta_kernel_property(numel, positions, dtype):
    old = _random((numel,), dtype)
    new = _perturb(old, sorted(p for p in positions if p < numel))
    assert torch.equal(bits(kernels.delta_apply(old, kernels.delta_encode(old, new))), bits(new))


def test_tensors_added_or_reshaped_are_stored_full():
    parent = {"kept": torch.ones(4), "reshaped": torch.ones(4), "dropped": torch.ones(2)}
    weights = {"kept": torch.ones(4), "reshaped": torch.ones(2, 2), "added": torch.arange(3.0)}
    encoded = codec.encode(parent, weights)
    assert {t.name: t.encoding for t in encoded.tensors} == {
        "kept": codec.SPARSE_DIFF,
        "reshaped": codec.FULL,
        "added": codec.FULL,
    }
    assert_bit_identical(
        codec.decode(encoded.blob, manifest_for(encoded, keyframe=False), parent), weights
    )


def test_sparse_delta_of_real_policy_weights_is_small():
    from rtrl.policy import build_model, state_dict_fp32

    parent = state_dict_fp32(build_model())
    weights = {name: tensor.clone() for name, tensor in parent.items()}
    weights["model.layers.0.mlp.up_proj.weight"].view(-1)[[5, 900, 40_000]] += 1e-3
    weights["model.norm.weight"][0] = 0.5
    keyframe = codec.encode(None, weights)
    encoded = codec.encode(parent, weights)
    assert len(encoded.blob) < len(keyframe.blob) / 50
    assert_bit_identical(
        codec.decode(encoded.blob, manifest_for(encoded, keyframe=False), parent), weights
    )


def _sparse_version():
    parent = {"a": _random((32, 16), torch.float32), "b": _random((8,), torch.bfloat16)}
    weights = {"a": _perturb(parent["a"], [1, 2, 300]), "b": _perturb(parent["b"], [7])}
    encoded = codec.encode(parent, weights)
    return parent, weights, encoded.blob, manifest_for(encoded, keyframe=False)


def test_corrupt_blob_raises_checksum_mismatch():
    parent, _, blob, manifest = _sparse_version()
    corrupt = bytearray(blob)
    corrupt[len(corrupt) // 2] ^= 0x40
    with pytest.raises(codec.ChecksumMismatch, match="blob of treatment v1"):
        codec.decode(bytes(corrupt), manifest, parent)


def test_tensor_that_does_not_match_its_checksum_is_refused():
    # The blob is intact but a tensor rebuilds to other bits than the trainer's.
    parent, _, blob, manifest = _sparse_version()
    manifest.tensors[1].checksum = "0" * 32
    with pytest.raises(codec.ChecksumMismatch, match="tensor b"):
        codec.decode(blob, manifest, parent)


def test_delta_on_the_wrong_parent_is_refused():
    parent, _, blob, manifest = _sparse_version()
    wrong_parent = {name: _perturb(tensor, [0]) for name, tensor in parent.items()}
    with pytest.raises(codec.ChecksumMismatch):
        codec.decode(blob, manifest, wrong_parent)
    with pytest.raises(codec.ParentMismatch):
        codec.decode(blob, manifest, None)


@pytest.mark.guarantee(4)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_tampered_blob_is_refused_never_misapplied(data):
    # Even when the attacker (or a bug) also fixes up the blob checksum, a changed byte or
    # a changed count is caught by the sections' structure or the tensors' checksums.
    parent, weights, blob, manifest = _sparse_version()
    tampered = bytearray(blob)
    for _ in range(data.draw(st.integers(1, 4))):
        tampered[data.draw(st.integers(0, len(blob) - 1))] ^= data.draw(st.integers(1, 255))
    recount = data.draw(st.booleans())
    if recount:
        manifest.tensors[data.draw(st.integers(0, 1))].changed += data.draw(
            st.sampled_from([-1, 1])
        )
    if bytes(tampered) == blob and not recount:
        return  # two flips cancelled out
    manifest.blob_checksum = xxh3_hex(bytes(tampered))
    try:
        decoded = codec.decode(bytes(tampered), manifest, parent)
    except codec.DecodeError:
        return
    assert_bit_identical(
        decoded, weights
    )  # a byte zstd ignores (e.g. a frame's padding) changed nothing


def test_a_frame_claiming_a_huge_size_is_refused_before_allocating():
    # A flipped bit in a zstd frame header once made decode ask for a MemoryError's worth.
    # (Found by test_any_tampered_blob_is_refused_never_misapplied: byte 4, XOR 208.)
    parent, _, blob, manifest = _sparse_version()
    tampered = bytearray(blob)
    tampered[4] ^= 208  # the frame header descriptor: the content size field changes width
    manifest.blob_checksum = xxh3_hex(bytes(tampered))
    with pytest.raises(codec.DecodeError, match="claims"):
        codec.decode(bytes(tampered), manifest, parent)


def test_varint_and_planes_round_trip_and_refuse_truncation():
    from rtrl.kernels.varint import (
        from_planes,
        leb128_decode,
        leb128_encode,
        to_planes,
        unzigzag,
        zigzag,
    )

    signed = torch.randint(-(2**62), 2**62, (500,)).numpy()
    signed[:4] = [0, -1, 1, -(2**62)]
    codes = zigzag(signed)
    assert codes[:3].tolist() == [0, 1, 2]
    assert (unzigzag(leb128_decode(leb128_encode(codes), len(codes))) == signed).all()
    assert (from_planes(to_planes(codes), len(codes)) == codes).all()
    small = codes[:3]
    assert len(to_planes(small)) == 3  # one plane: every value fits a byte
    with pytest.raises(ValueError):
        leb128_decode(leb128_encode(codes)[:-1], len(codes))
    with pytest.raises(ValueError):
        leb128_decode(leb128_encode(codes), len(codes) - 1)
    with pytest.raises(ValueError):
        from_planes(to_planes(codes)[:-1], len(codes))


# ---- lineage: which versions a subscriber is sent, which publishes are accepted ----


def _manifests(spec: str) -> dict[int, weights_pb2.Manifest]:
    """'K d d x K d': version i is a keyframe (K), a delta (d) or unavailable (x)."""
    out = {}
    for version, kind in enumerate(spec.split()):
        if kind != "x":
            out[version] = weights_pb2.Manifest(
                version=version,
                keyframe=kind == "K",
                parent_version=-1 if kind == "K" else version - 1,
            )
    return out


@pytest.mark.parametrize(
    "spec, have, expected",
    [
        ("K d d d", -1, [0, 1, 2, 3]),  # a new subscriber starts from the keyframe
        ("K d d d", 1, [2, 3]),  # a subscriber holding v1 gets only deltas
        ("K d d d", 3, []),  # up to date
        ("K d d K d", 1, [3, 4]),  # v3 is no delta: jump to the newest keyframe
        ("K d d K d", 3, [4]),
        ("K d x d", 0, None),  # broken chain and no later keyframe: no path
        ("K d x d K d", 0, [4, 5]),  # broken chain repaired by a later keyframe
        ("K d d x", 1, None),  # the latest version itself is unavailable
        ("x d d K", 1, [3]),
        ("K d d", 7, [0, 1, 2]),  # holding a version the registry does not know: start over
    ],
)
def test_sync_path(spec, have, expected):
    available = _manifests(spec)
    latest = len(spec.split()) - 1
    keyframes = [v for v, kind in enumerate(spec.split()) if kind == "K"]
    assert (
        lineage.sync_path(have, latest, keyframes[-1] if keyframes else None, available) == expected
    )


@pytest.mark.parametrize(
    "keyframe, parent, latest, newest_keyframe, accepted",
    [
        (True, -1, -1, None, True),  # first version of an arm
        (False, -1, -1, None, False),  # ... must be a keyframe
        (False, 4, 4, 0, True),
        (False, 3, 4, 0, False),  # stale parent
        (True, 3, 4, 0, False),  # a keyframe also needs the latest as its parent token
        (False, 4, 4, 1, True),
        (False, 4, 4, 0, True),  # chain 1..5 with keyframe_every=6
        (False, 5, 5, 0, False),  # v6 would make the chain as long as keyframe_every
        (True, 5, 5, 0, True),
    ],
)
def test_publish_problem(keyframe, parent, latest, newest_keyframe, accepted):
    manifest = weights_pb2.Manifest(arm="treatment", keyframe=keyframe, parent_version=parent)
    assert (
        lineage.publish_problem(manifest, latest, newest_keyframe, keyframe_every=6) is None
    ) == accepted


def test_publisher_cadence_is_accepted_by_the_server_rule():
    newest_keyframe, latest = None, -1
    for version in range(50):
        keyframe = lineage.keyframe_due(version, 7)
        manifest = weights_pb2.Manifest(arm="a", keyframe=keyframe, parent_version=latest)
        assert lineage.publish_problem(manifest, latest, newest_keyframe, keyframe_every=7) is None
        latest, newest_keyframe = version, version if keyframe else newest_keyframe
