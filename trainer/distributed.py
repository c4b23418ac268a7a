"""The training step on several processes: the same optimizer step as rl_step, with
the model sharded by FSDP and the batch's rows split between ranks.

FSDP2 (``fully_shard`` per decoder layer, then the root) is the wrapper: in torch
2.13 it runs forward, backward, gradient clipping and AdamW on CPU with gloo, and it
keeps parameter names and the tied embedding as they are, so published weights have
the unwrapped model's keys.

Under torchrun, rank 0 consumes rewards and broadcasts each batch (broadcast_batch),
every rank calls sharded_rl_step, and rank 0 publishes full_state_dict.
``python -m rtrl.simulator.sharded_run`` trains on synthetic production-shaped batches, on
one process with rl_step or under torchrun with sharded_rl_step, so the two can be
compared step by step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from rtrl.trainer.batch import TrainBatch
from rtrl.trainer.mismatch import Mismatch, Probe, merge
from rtrl.trainer.objective import leave_one_out_advantages, policy_gradient_loss
from rtrl.trainer.router_replay import replaying
from rtrl.trainer.step import StepMetrics, measure_probe, token_logprobs

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger("rtrl.trainer.distributed")


@dataclass(frozen=True)
class World:
    """This process's place among the training ranks."""

    rank: int
    world_size: int


def init_world(backend: str | None = None) -> World | None:
    """Join the process group torchrun describes in the environment; None when not
    launched by torchrun with more than one process."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    return World(rank=dist.get_rank(), world_size=dist.get_world_size())


def close_world() -> None:
    """Leave the process group once every rank is done with its collectives; every
    rank must call it."""
    dist.barrier()
    dist.destroy_process_group()


def shard(model: PreTrainedModel, world: World) -> torch.nn.Module:
    """Shard a causal LM in place: each decoder layer (the blocks transformers keeps whole,
    ``_no_split_modules``) is its own FSDP unit (its weights are gathered only while it
    runs); the root holds the embeddings, the LM head and the final norm."""
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if device_type == "cuda":
        # transformers wraps to() in functools.wraps, which typeshed types as an unbound function.
        model.to(torch.device("cuda", torch.cuda.current_device()))  # type: ignore[arg-type]
    mesh = init_device_mesh(device_type, (world.world_size,))
    blocks = set(model._no_split_modules or ())
    for layer in [m for m in model.modules() if type(m).__name__ in blocks]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def row_range(rows: int, world: World) -> tuple[int, int]:
    """This rank's contiguous rows; the first ``rows % world_size`` ranks take one more."""
    base, extra = divmod(rows, world.world_size)
    start = world.rank * base + min(world.rank, extra)
    return start, start + base + (world.rank < extra)


def broadcast_batch(batch: TrainBatch | None, world: World) -> TrainBatch:
    """Rank 0's batch on every rank (the others pass None)."""
    box = [batch if world.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    received = box[0]
    assert received is not None  # rank 0's batch, now on every rank
    return received


@dataclass(frozen=True)
class LocalObjective:
    loss: torch.Tensor
    """This rank's share of the batch's loss, times world_size, to backpropagate."""
    sums: torch.Tensor
    """Float64 [loss, kl, clipped, ratio, entropy] summed over this rank's completion
    tokens; all-reduced and divided by the batch's tokens they are rl_step's metrics."""
    mismatch: Mismatch
    """Over this rank's rows; the ranks' are merged (trainer.mismatch.merge)."""


@dataclass(frozen=True)
class LocalRows:
    """This rank's rows of a batch, on the model's device."""

    batch: TrainBatch
    start: int
    stop: int
    """The rows' range in the whole batch (the placeholder row 0 for a rank without tokens)."""
    tokens: int
    """Their completion tokens (0: the rows are a placeholder)."""


def local_rows(batch: TrainBatch, world: World, device: torch.device) -> LocalRows:
    """This rank's rows (row_range) on device; a rank without completion tokens gets row 0 as
    a placeholder, since FSDP's gathers and reductions need every rank to run the models."""
    start, stop = row_range(len(batch.rewards), world)
    tokens = batch.target_mask[start:stop].sum().item()
    if tokens == 0:
        start, stop = 0, 1
    rows = batch.select(range(start, stop))
    rows = dataclasses.replace(
        rows,
        input_ids=rows.input_ids.to(device),
        target_mask=rows.target_mask.to(device),
        behaviour_logprobs=rows.behaviour_logprobs.to(device),
        temperature=rows.temperature.to(device),
    )
    return LocalRows(rows, start, stop, int(tokens))


def local_objective(
    model: torch.nn.Module,
    batch: TrainBatch,
    advantages: torch.Tensor,
    world: World,
    *,
    ref_model: torch.nn.Module | None = None,
    is_cap: float = 2.0,
    kl_coef: float = 0.0,
    probe: Probe | None = None,
    router_replay: bool = True,
) -> LocalObjective:
    """rl_step's objective on this rank's rows of the whole batch.

    policy_gradient_loss divides the rows' sum by the rows' tokens; scaled by
    rows_tokens / batch_tokens that is the rows' share of the whole batch's loss, and
    by world_size because FSDP averages gradients over ranks, so the reduced gradient
    is rl_step's. A rank without tokens (fewer rows than ranks) runs its models on a
    placeholder row with a zero loss, since FSDP's gathers and reductions need every
    rank.
    """
    batch_tokens = batch.target_mask.sum().item()
    device = next(model.parameters()).device
    local = local_rows(batch, world, device)
    rows = local.batch
    ref_logp = None
    # A MoE's forwards take the experts the sampler chose (trainer/router_replay.py).
    with replaying(rows, (model, ref_model), enabled=router_replay):
        if ref_model is not None:
            with torch.no_grad():
                ref_logp, _ = token_logprobs(ref_model, rows)
        logp, entropy = token_logprobs(model, rows)
    sums = torch.zeros(5, dtype=torch.float64, device=device)
    if local.tokens == 0:
        return LocalObjective(loss=logp.sum() * 0.0, sums=sums, mismatch=Mismatch())
    terms = policy_gradient_loss(
        logp,
        rows.behaviour_logprobs,
        advantages[local.start : local.stop].to(device),
        rows.target_mask,
        ref_logp=ref_logp,
        is_cap=is_cap,
        kl_coef=kl_coef,
    )
    means = [terms.loss.item(), terms.kl, terms.clipped_fraction, terms.ratio_mean]
    sums[:4] = torch.tensor(means, dtype=torch.float64) * local.tokens
    sums[4] = (entropy * rows.target_mask).sum().double()
    if probe is not None:
        probe = dataclasses.replace(
            probe, token_versions=probe.token_versions[local.start : local.stop]
        )
    return LocalObjective(
        loss=terms.loss * (local.tokens * world.world_size / batch_tokens),
        sums=sums,
        mismatch=measure_probe(logp, rows, probe),
    )


def sharded_rl_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    world: World,
    *,
    ref_model: torch.nn.Module | None = None,
    is_cap: float = 2.0,
    kl_coef: float = 0.0,
    grad_clip: float = 1.0,
    std_normalize: bool = False,
    probe: Probe | None = None,
    router_replay: bool = True,
) -> StepMetrics:
    """rl_step on a sharded model; every rank passes the whole batch (and probe) and trains
    on its rows. Advantages come from the whole batch, so comparison groups may span ranks."""
    batch_tokens = batch.target_mask.sum().item()
    if batch_tokens == 0:
        raise ValueError("no completion tokens in the batch")
    advantages = torch.tensor(
        leave_one_out_advantages(batch.rewards, batch.groups, std_normalize=std_normalize)
        if batch.advantages is None
        else batch.advantages
    )
    model.train()
    local = local_objective(
        model,
        batch,
        advantages,
        world,
        ref_model=ref_model,
        is_cap=is_cap,
        kl_coef=kl_coef,
        probe=probe,
        router_replay=router_replay,
    )
    optimizer.zero_grad(set_to_none=True)
    local.loss.backward()
    grad_norm = _clip_global_grad_norm(model, grad_clip)
    optimizer.step()
    model.eval()
    dist.all_reduce(local.sums)
    loss, kl, clipped, ratio, entropy = (local.sums / batch_tokens).tolist()
    ranks: list[Mismatch | None] = [None] * world.world_size
    dist.all_gather_object(ranks, local.mismatch)
    return StepMetrics(
        loss=loss,
        kl=kl,
        entropy=entropy,
        grad_norm=grad_norm,
        reward_mean=sum(batch.rewards) / len(batch.rewards),
        advantage_abs_mean=advantages.abs().mean().item(),
        clipped_fraction=clipped,
        ratio_mean=ratio,
        rollouts=len(batch.rewards),
        tokens=int(batch_tokens),
        mismatch=merge([rank for rank in ranks if rank is not None]),
    )


def _clip_global_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """clip_grad_norm_ by the norm of the full gradients: over FSDP2's sharded
    gradients get_total_norm already reduces across ranks and returns it replicated."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, total)
    return total.item()


def full_state_dict(model: torch.nn.Module, world: World) -> dict[str, torch.Tensor] | None:
    """The unsharded fp32 weights on rank 0 (None elsewhere), with the keys
    rtrl.policy.state_dict_fp32 gives the unwrapped model. Every rank must call it;
    tensors are gathered one at a time, so no rank holds more than one beyond its shards."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if world.rank == 0:
            out[name] = full.detach().to("cpu", torch.float32).contiguous().clone()
    return out if world.rank == 0 else None
