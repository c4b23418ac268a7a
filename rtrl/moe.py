"""Mixture-of-experts router replay: record the experts a policy chose while sampling, and
make the trainer's forward use exactly those.

A MoE layer's top-k is a discontinuous function of its input: two experts whose router
logits are nearly tied swap places under any rounding difference (an incremental
KV-cache decode against a full-sequence forward, another batch shape, another kernel,
or weights one step newer). A swapped expert changes the token's log-prob by far more
than the rounding that caused it, so the trainer's π_current/π_behaviour ratio would
measure routing noise instead of the policy. Replaying the sampler's choices keeps the
routing of the behaviour policy; gradients still reach the router through the scores
of the replayed experts.

A router is any module with the top-k router contract of transformers' MoE models
(Qwen3-MoE's ``Qwen3MoeTopKRouter``, Mixtral's ``MixtralTopKRouter``): ``top_k`` and
``num_experts`` attributes, a ``weight`` of shape [num_experts, hidden], and a forward
from hidden states [tokens, hidden] to ``(router_logits, scores, indices)``. A model's
routers are listed in module order, which is layer order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rtrl.v1 import rollout_pb2


@dataclass(frozen=True)
class Router:
    """One MoE layer's router, as replay needs to know it."""

    module: torch.nn.Module
    top_k: int
    num_experts: int
    renormalizes: bool
    """Its top-k weights are renormalized to sum to 1 (``norm_topk_prob``; Mixtral always)."""


def as_router(module: torch.nn.Module) -> Router | None:
    """``module`` as a Router if it has the top-k router contract (module docstring)."""
    top_k, num_experts = getattr(module, "top_k", None), getattr(module, "num_experts", None)
    weight = getattr(module, "weight", None)
    if not (
        isinstance(top_k, int)
        and isinstance(num_experts, int)
        and 0 < top_k <= num_experts
        and isinstance(weight, torch.nn.Parameter)
        and weight.dim() == 2
        and weight.shape[0] == num_experts
    ):
        return None
    renormalizes = bool(getattr(module, "norm_topk_prob", True))
    return Router(module, top_k, num_experts, renormalizes)


def routers(model: torch.nn.Module) -> list[Router]:
    """The model's routers in layer order; empty for a dense model."""
    found = (as_router(module) for module in model.modules())
    return [router for router in found if router is not None]


@dataclass
class RouteLog:
    """The experts each router chose, one [tokens, top_k] tensor per router call."""

    calls: list[list[torch.Tensor]] = field(default_factory=list)
    """Per router (layer order), per forward: the chosen expert ids."""

    def per_layer(self) -> list[torch.Tensor]:
        """Per layer, the calls concatenated along tokens: [tokens, top_k] int64."""
        return [torch.cat(layer) for layer in self.calls]

    def stacked(self) -> torch.Tensor:
        """[tokens, layers, top_k]: the layout of a rollout's record (pack_routes)."""
        return torch.stack(self.per_layer(), dim=1)


@contextmanager
def record_routes(model: torch.nn.Module) -> Iterator[RouteLog]:
    """Record every router call of the forwards run inside the block.

    The router sees its input flattened to [batch × positions, hidden], batch-major: a
    forward over B sequences of T positions adds B·T rows, row b·T + t for (b, t). A
    worker decoding on a KV cache wraps each forward of a rollout (the prefill, then
    every step); the rows of all of them, in order, are the rollout's routes.
    """
    found = routers(model)
    log = RouteLog(calls=[[] for _ in found])

    def hook_for(layer: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            log.calls[layer].append(output[2].detach().to("cpu", torch.int64))

        return hook

    handles = [r.module.register_forward_hook(hook_for(i)) for i, r in enumerate(found)]
    try:
        yield log
    finally:
        for handle in handles:
            handle.remove()


def _layer_choices(
    choices: torch.Tensor | Sequence[torch.Tensor], found: Sequence[Router]
) -> list[torch.Tensor]:
    """Per router, [tokens, top_k]: from a list per layer or a tensor [..., layers, top_k]
    whose leading dimensions flatten to tokens in the router's (batch-major) order."""
    if isinstance(choices, torch.Tensor) and choices.dim() < 3:
        raise ValueError(f"routes of shape {tuple(choices.shape)}, expected [..., layers, top_k]")
    per_layer = (
        list(choices.flatten(0, -3).unbind(1)) if isinstance(choices, torch.Tensor) else choices
    )
    if len(per_layer) != len(found):
        raise ValueError(f"routes for {len(per_layer)} MoE layers; the model has {len(found)}")
    for layer, (ids, router) in enumerate(zip(per_layer, found, strict=True)):
        top_k, num_experts = router.top_k, router.num_experts
        if ids.dim() != 2 or ids.shape[1] != top_k:
            raise ValueError(
                f"layer {layer}: routes of shape {tuple(ids.shape)}, expected [tokens, {top_k}]"
            )
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
            raise ValueError(f"layer {layer}: expert ids outside [0, {num_experts})")
    return list(per_layer)


def replayed_scores(router: Router, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The weights ``router`` gives experts ``ids``, computed as its own forward does for
    the experts it picks: softmax over all logits in float32, gathered, renormalized."""
    probs = torch.softmax(logits.float(), dim=-1)
    scores = probs.gather(-1, ids)
    if router.renormalizes:
        scores = scores / scores.sum(dim=-1, keepdim=True)
    return scores


@contextmanager
def replay_routes(
    model: torch.nn.Module, choices: torch.Tensor | Sequence[torch.Tensor]
) -> Iterator[None]:
    """Make every router of ``model`` use ``choices`` instead of its own top-k.

    ``choices``: per layer [tokens, top_k], or one tensor [..., layers, top_k] (e.g. a
    batch's [B, L, layers, top_k]). Every forward inside the block must route exactly
    that many tokens (a forward's router input is [B·L, hidden]); the router still
    computes its logits, so the replayed experts' scores carry the router's gradient.
    """
    found = routers(model)
    per_layer = _layer_choices(choices, found)

    def hook_for(layer: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> tuple[torch.Tensor, ...]:
            logits, scores, _ = output
            ids = per_layer[layer].to(logits.device, torch.int64)
            if ids.shape[0] != logits.shape[0]:
                raise ValueError(
                    f"layer {layer}: routes for {ids.shape[0]} tokens, the forward routes "
                    f"{logits.shape[0]}"
                )
            return logits, replayed_scores(found[layer], logits, ids).to(scores.dtype), ids

        return hook

    handles = [r.module.register_forward_hook(hook_for(i)) for i, r in enumerate(found)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def pack_routes(routes: torch.Tensor, num_experts: int) -> rollout_pb2.RouterChoices:
    """A rollout's routes [positions, layers, top_k] as its record's ``router_choices``."""
    if routes.dim() != 3:
        raise ValueError(f"routes of shape {tuple(routes.shape)}, expected [positions, layers, k]")
    dtype = _id_dtype(num_experts)
    ids = routes.to("cpu", torch.int64).numpy()
    if ids.size and (ids.min() < 0 or ids.max() >= num_experts):
        raise ValueError(f"expert ids outside [0, {num_experts})")
    return rollout_pb2.RouterChoices(
        layers=routes.shape[1],
        top_k=routes.shape[2],
        num_experts=num_experts,
        expert_ids=ids.astype(dtype).tobytes(),
    )


def unpack_routes(record: rollout_pb2.RouterChoices) -> torch.Tensor:
    """The record's routes [positions, layers, top_k], as uint8 up to 256 experts (else
    int32): a trainer holds many pending rollouts' routes, and int64 would be eight times
    the record; replay_routes widens one layer at a time."""
    dtype = _id_dtype(record.num_experts)
    width = record.layers * record.top_k * dtype.itemsize
    if not width or len(record.expert_ids) % width:
        raise ValueError(
            f"{len(record.expert_ids)} bytes of expert ids do not fill rows of "
            f"{record.layers} layers × {record.top_k} experts"
        )
    ids = np.frombuffer(record.expert_ids, dtype=dtype)
    if ids.size and ids.max() >= record.num_experts:
        raise ValueError(f"expert ids outside [0, {record.num_experts})")
    wide = ids.copy() if dtype.itemsize == 1 else ids.astype(np.int32)
    return torch.from_numpy(wide).view(-1, record.layers, record.top_k)


def _id_dtype(num_experts: int) -> np.dtype[Any]:
    """One byte per expert id up to 256 experts, else two (little-endian)."""
    if not 0 < num_experts <= 65536:
        raise ValueError(f"num_experts {num_experts} outside [1, 65536]")
    return np.dtype("u1") if num_experts <= 256 else np.dtype("<u2")
