"""What a weight version must hold to be served: the model's tensors, by name, shape and
dtype, read from its transformers config alone (the engine checks each version against
it before staging, so applying one cannot fail)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig


class TensorLayout:
    """Every tensor a model of ``config`` holds (on the meta device: shape and dtype, no
    memory, no initialization), and the names a version must carry: each tied tensor
    once, under its first name, as rtrl.policy.state_dict_fp32 lists them."""

    def __init__(self, config: PretrainedConfig, model_type: str) -> None:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        self.model_type = model_type
        self.tensors: dict[str, torch.Tensor] = model.state_dict(keep_vars=True)
        """Name -> the model's tensor (tied names hold the very same Parameter)."""
        seen: set[int] = set()
        required = []
        for name, tensor in self.tensors.items():
            if id(tensor) not in seen:
                seen.add(id(tensor))
                required.append(name)
        self.required = frozenset(required)
        """The names a version must carry."""

    def check(self, weights: dict[str, torch.Tensor]) -> None:
        """Raise ValueError unless ``weights`` fit: every tensor the model needs, none it
        does not know, each of the model's shape and of a dtype it takes without changing
        kind (any floating-point dtype for a floating tensor, served as float32; the very
        same dtype otherwise)."""
        missing = sorted(self.required - weights.keys())
        unknown = sorted(weights.keys() - self.tensors.keys())
        known = sorted((n, t, self.tensors[n]) for n, t in weights.items() if n in self.tensors)
        wrong_shape = [
            f"{n} {tuple(t.shape)} (want {tuple(want.shape)})"
            for n, t, want in known
            if t.shape != want.shape
        ]
        wrong_dtype = [
            f"{n} {t.dtype} (want {want.dtype})"
            for n, t, want in known
            if t.dtype != want.dtype and not (t.is_floating_point() and want.is_floating_point())
        ]
        if missing or unknown or wrong_shape or wrong_dtype:
            raise ValueError(
                f"weights do not fit the {self.model_type} model: missing={missing[:5]} "
                f"unknown={unknown[:5]} wrong_shape={wrong_shape[:5]} wrong_dtype={wrong_dtype[:5]}"
            )
