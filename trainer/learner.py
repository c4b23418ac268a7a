"""Who holds the policy being trained: one process, or every rank of a torchrun group.

The trainer loop (rank 0) only talks to a Learner: step on a batch, hand over the
full weights, remember the published state, go back to it after a refusal, save and
load checkpoints. ``LocalLearner`` does all of it in this process. ``ShardedLearner``
shards the model with FSDP over the torchrun group; on rank 0 each call first
broadcasts a command, and the other ranks run ``follow()``, which receives the
commands and makes the same collective calls in the same order. Only rank 0 touches
Kafka, the journal, the eval gate and weight_sync.
"""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rtrl.policy import load_weights, state_dict_fp32
from rtrl.trainer.batch import TrainBatch
from rtrl.trainer.config import TrainerSettings
from rtrl.trainer.mismatch import Probe
from rtrl.trainer.step import StepMetrics, build_optimizer, rl_step

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from rtrl.trainer.distributed import World

log = logging.getLogger("trainer")


class LocalLearner:
    def __init__(
        self, model: torch.nn.Module, ref_model: torch.nn.Module, settings: TrainerSettings
    ) -> None:
        self.model = model
        self.ref_model = ref_model
        self.settings = settings
        self.optimizer = build_optimizer(model, settings.lr, settings.weight_decay)
        self._published: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None

    def step(self, batch: TrainBatch, probe: Probe | None = None) -> StepMetrics:
        """probe: what the train–inference mismatch is measured on (trainer.mismatch)."""
        s = self.settings
        return rl_step(
            self.model,
            self.optimizer,
            batch,
            ref_model=self.ref_model,
            is_cap=s.is_cap,
            kl_coef=s.kl_coef,
            grad_clip=s.grad_clip,
            std_normalize=s.std_normalize,
            probe=probe,
            token_budget=s.micro_batch_tokens,
            router_replay=s.router_replay,
        )

    def weights(self) -> dict[str, torch.Tensor]:
        return state_dict_fp32(self.model)

    def eval_model(self) -> torch.nn.Module:
        """A model holding the current weights, for the eval gate."""
        return self.model

    def snapshot(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """A copy of the current weights and optimizer state (training goes on without touching it)."""
        return state_dict_fp32(self.model), copy.deepcopy(self.optimizer.state_dict())

    def remember(
        self, published: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None
    ) -> None:
        """This state (by default the current one) is published: a refused candidate returns here."""
        self._published = published if published is not None else self.snapshot()

    def restore(self) -> None:
        assert self._published is not None  # the trainer remembers its starting state first
        weights, optimizer_state = self._published
        load_weights(self.model, weights)
        self.optimizer.load_state_dict(copy.deepcopy(optimizer_state))

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(weights, optimizer state) for a checkpoint."""
        return state_dict_fp32(self.model), self.optimizer.state_dict()

    def load(
        self, weights: dict[str, torch.Tensor], optimizer_state: dict[str, Any] | None
    ) -> None:
        load_weights(self.model, weights)
        if optimizer_state is None:
            return
        if any(isinstance(key, str) for key in optimizer_state.get("state", {})):
            log.warning(
                "the checkpoint's optimizer state is from a sharded run; Adam's moments restart"
            )
            return
        self.optimizer.load_state_dict(optimizer_state)

    def close(self) -> None:
        pass


class ShardedLearner:
    """The model sharded over the torchrun group (trainer.distributed); rank 0 drives.

    Checkpoints hold the full optimizer state keyed by parameter name
    (torch.distributed.checkpoint's format), which a one-process run does not read:
    switching between the two keeps the weights and restarts Adam's moments.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        ref_model: PreTrainedModel,
        settings: TrainerSettings,
        world: World,
    ) -> None:
        from rtrl.trainer.distributed import shard

        self.world = world
        self.settings = settings
        self.eval_copy = copy.deepcopy(model) if world.rank == 0 else None
        self.model = shard(model, world)
        self.ref_model = shard(ref_model, world)
        self.optimizer = build_optimizer(self.model, settings.lr, settings.weight_decay)
        self._published: tuple[list[torch.Tensor], dict[str, Any]] | None = None

    # Rank 0's side: broadcast the command, then take part in it.

    def step(self, batch: TrainBatch, probe: Probe | None = None) -> StepMetrics:
        self._command("step", (batch, probe))
        return self._step(batch, probe)

    def weights(self) -> dict[str, torch.Tensor]:
        self._command("weights")
        weights = self._weights()
        assert weights is not None  # gathered on rank 0, which runs this
        return weights

    def eval_model(self) -> torch.nn.Module:
        assert self.eval_copy is not None  # rank 0 keeps one
        load_weights(self.eval_copy, self.weights())
        return self.eval_copy

    def remember(self) -> None:
        self._command("remember")
        self._remember()

    def restore(self) -> None:
        self._command("restore")
        self._restore()

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        self._command("state")
        state = self._state()
        assert state is not None  # gathered on rank 0, which runs this
        return state

    def load(
        self, weights: dict[str, torch.Tensor], optimizer_state: dict[str, Any] | None
    ) -> None:
        self._command("load", optimizer_state is not None)
        self._load(weights, optimizer_state)

    def close(self) -> None:
        self._command("close")

    # Every other rank.

    def follow(self) -> None:
        """Run rank 0's commands until it closes the group."""
        while True:
            op, payload = self._receive()
            if op == "close":
                return
            if op == "step":
                self._step(*payload)
            elif op == "weights":
                self._weights()
            elif op == "remember":
                self._remember()
            elif op == "restore":
                self._restore()
            elif op == "state":
                self._state()
            elif op == "load":
                self._load(None, {} if payload else None)
            else:
                raise RuntimeError(f"unknown command {op!r} from rank 0")

    # The collective work, the same on every rank.

    def _command(self, op: str, payload: Any = None) -> None:
        dist.broadcast_object_list([(op, payload)], src=0)

    def _receive(self) -> tuple[str, Any]:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _step(self, batch: TrainBatch, probe: Probe | None) -> StepMetrics:
        from rtrl.trainer.distributed import sharded_rl_step

        s = self.settings
        return sharded_rl_step(
            self.model,
            self.optimizer,
            batch,
            self.world,
            ref_model=self.ref_model,
            is_cap=s.is_cap,
            kl_coef=s.kl_coef,
            grad_clip=s.grad_clip,
            std_normalize=s.std_normalize,
            probe=probe,
            router_replay=s.router_replay,
        )

    def _weights(self) -> dict[str, torch.Tensor] | None:
        from rtrl.trainer.distributed import full_state_dict

        return full_state_dict(self.model, self.world)

    def _remember(self) -> None:
        # Each rank keeps its own shards: restoring needs no communication.
        local = [p.detach().clone() for p in self.model.parameters()]
        self._published = (local, copy.deepcopy(self.optimizer.state_dict()))

    def _restore(self) -> None:
        assert self._published is not None  # the trainer remembers its starting state first
        local, optimizer_state = self._published
        with torch.no_grad():
            for parameter, saved in zip(self.model.parameters(), local, strict=True):
                parameter.copy_(saved)
        self.optimizer.load_state_dict(copy.deepcopy(optimizer_state))

    def _state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        weights = self._weights()
        optimizer_state = get_optimizer_state_dict(
            self.model,
            self.optimizer,
            options=StateDictOptions(full_state_dict=True, cpu_offload=True),
        )
        if self.world.rank != 0:
            return None
        assert weights is not None  # gathered on rank 0
        return weights, optimizer_state

    def _load(
        self, weights: dict[str, torch.Tensor] | None, optimizer_state: dict[str, Any] | None
    ) -> None:
        """Rank 0 passes full weights (and optimizer state); the others receive them."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        box = [weights if self.world.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        received = box[0]
        assert received is not None  # rank 0's weights, now on every rank
        # strict=False: the checkpoint lists tied weights once. The ignore: torch types the
        # state dict as an (invariant) dict of its ValueType union, which a dict of tensors is not.
        set_model_state_dict(
            self.model,
            received,  # type: ignore[arg-type]
            options=StateDictOptions(full_state_dict=True, strict=False),
        )
        if optimizer_state is None:
            return
        usable = [
            self.world.rank != 0
            or "state" in optimizer_state
            and all(isinstance(k, str) for k in optimizer_state["state"])
        ]
        dist.broadcast_object_list(usable, src=0)
        if not usable[0]:
            if self.world.rank == 0:
                log.warning(
                    "the checkpoint's optimizer state is from a one-process run; Adam's moments restart"
                )
            return
        set_optimizer_state_dict(
            self.model,
            self.optimizer,
            optimizer_state if self.world.rank == 0 else {},
            options=options,
        )


Learner = LocalLearner | ShardedLearner
"""What the trainer loop trains with: this process, or rank 0 of a torchrun group."""
