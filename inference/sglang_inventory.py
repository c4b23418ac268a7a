"""What a running SGLang server holds — every tensor's name, shape and dtype, read from
the checkpoint it was launched on — and the check a version must pass against it
before it is sent.

Three things SGLang 0.5.23 does not refuse, so the sidecar (inference/sglang_sidecar.py)
checks them itself before it pauses anything: a tensor whose shape differs from the
served parameter kills the server's scheduler (an AssertionError in its weight loader
takes the whole server down), a tensor with an unknown name is skipped while the server
still reports the new version, and a tensor of another kind of dtype (integers into a
float parameter) is silently converted. A version must therefore match what the server
loaded from the checkpoint (``served_inventory``): the same names and shapes,
floating-point tensors where it serves floating point (sent in the dtype it serves,
``--dtype``); one that does not is rejected and never sent.

Only config.json and the safetensors headers are read, never tensor data, so the
inventory of a large checkpoint is cheap to build at start-up.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rtrl.inference.sglang_weight_protocol import SGLangWeights


class WeightsRejected(ValueError):
    """A version does not fit the served model; it is never sent to SGLang."""


@dataclass(frozen=True)
class ServedTensor:
    """One tensor as the server holds it, which a version's tensor of that name must match."""

    shape: tuple[int, ...]
    dtype: str
    """torch's name of the dtype the server holds it in (``float32``, ``bfloat16``...)."""


# safetensors' dtype names → torch's.
_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
# What the dense (unquantized) weights of a checkpoint are stored and served in; anything
# else (fp8, packed integers) SGLang loads as stored.
_DENSE_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})
# SGLang's --dtype spellings (sglang/srt/configs/model_config.py).
_SGLANG_DTYPES = {
    "half": "float16",
    "float16": "float16",
    "float": "float32",
    "float32": "float32",
    "bfloat16": "bfloat16",
}
# Tensors SGLang's loaders skip (rotary tables some checkpoints store): never served.
_SKIPPED = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def served_dtype(server_dtype: str, config: Mapping[str, Any]) -> str:
    """The dtype SGLang 0.5.23 holds a checkpoint's dense weights in, for its ``--dtype``
    and the checkpoint's config.json (sglang/srt/configs/model_config.py,
    ``_get_and_verify_dtype``): ``auto`` keeps the config's dtype, except that float32
    checkpoints are served in float16 (bfloat16 for Gemma)."""
    if server_dtype.lower() != "auto":
        return _SGLANG_DTYPES[server_dtype.lower()]
    text = config.get("text_config") or config
    stored = text.get("dtype") or text.get("torch_dtype") or config.get("dtype") or "float32"
    if _SGLANG_DTYPES.get(stored, "float32") != "float32":
        return _SGLANG_DTYPES[stored]
    return "bfloat16" if str(text.get("model_type", "")).startswith("gemma") else "float16"


def served_inventory(model_dir: Path, server_dtype: str = "float32") -> dict[str, ServedTensor]:
    """Name → shape and dtype of every tensor a server launched on ``model_dir`` with
    ``--dtype server_dtype`` holds, read from config.json and the safetensors headers (no
    tensor data is loaded). Left out: what SGLang's loaders skip (rotary tables) and,
    with tied embeddings, ``lm_head.weight`` (the embedding is the head: a version
    changes both through ``model.embed_tokens.weight``)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    dense = served_dtype(server_dtype, config)
    tied = bool(config.get("tie_word_embeddings", False))
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    inventory: dict[str, ServedTensor] = {}
    for path in files:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, meta in header.items():
            if name == "__metadata__" or name.endswith(_SKIPPED):
                continue
            if tied and name == "lm_head.weight":
                continue
            stored = _SAFETENSORS_DTYPES.get(meta["dtype"], meta["dtype"])
            inventory[name] = ServedTensor(
                tuple(meta["shape"]), dense if stored in _DENSE_DTYPES else stored
            )
    return inventory


def inventory_of(weights: SGLangWeights, model_dir: Path) -> dict[str, ServedTensor]:
    """The inventory of the server behind ``weights``, launched on ``model_dir``: refuses
    (ValueError) a server that loaded a model of other architectures, and reads the
    dtype it serves from the server itself."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    expected, served = list(config.get("architectures") or []), weights.architectures()
    if expected and served and expected != served:
        raise ValueError(
            f"{weights.url} serves {served}, but the sidecar's model_dir {model_dir} holds {expected}"
        )
    return served_inventory(model_dir, weights.dtype())


def check_fits(
    version: int, tensors: Mapping[str, Any], inventory: Mapping[str, ServedTensor]
) -> None:
    """Raise WeightsRejected unless ``tensors`` has exactly the served names and shapes,
    and each a dtype the served one can take without changing kind: any floating-point
    dtype for a dense weight (sent converted to the served dtype), the very same dtype
    otherwise. A partial version would leave old tensors under the new version's label."""
    unknown = sorted(set(tensors) - set(inventory))
    missing = sorted(set(inventory) - set(tensors))
    wrong_shape = sorted(
        f"{name} {tuple(t.shape)} (served {inventory[name].shape})"
        for name, t in tensors.items()
        if name in inventory and tuple(t.shape) != inventory[name].shape
    )
    wrong_dtype = sorted(
        f"{name} {_dtype_name(t)} (served {inventory[name].dtype})"
        for name, t in tensors.items()
        if name in inventory and not _convertible(_dtype_name(t), inventory[name].dtype)
    )
    if unknown or missing or wrong_shape or wrong_dtype:
        raise WeightsRejected(
            f"v{version} does not fit the served model: unknown {unknown[:5]}, "
            f"missing {missing[:5]}, wrong shape {wrong_shape[:5]}, wrong dtype {wrong_dtype[:5]}"
        )


def as_served(tensors: Mapping[str, Any], inventory: Mapping[str, ServedTensor]) -> dict[str, Any]:
    """``tensors`` (checked by check_fits) in the dtypes the server holds them in: what it
    would round them to on load, converted here so the upload is no larger than needed."""
    import torch

    return {name: t.to(getattr(torch, inventory[name].dtype)) for name, t in tensors.items()}


def _dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _convertible(dtype: str, served: str) -> bool:
    return dtype == served or (dtype in _DENSE_DTYPES and served in _DENSE_DTYPES)
