"""The trainer's plug-ins: where the first version comes from and what judges candidates.

Both are named in TrainerSettings (``initial_policy``, ``eval_suite``) and loaded at
start-up. The trainer has no default of its own for either: a model directory
(RTRL_MODEL_DIR) is a policy, and the label-free gate judges it; the embedded demo names
the simulated product's (ops/stack.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, cast

from rtrl import plugins
from rtrl.policy import PolicyConfig
from rtrl.trainer.config import TrainerSettings
from rtrl.trainer.evaluation import Suite


class InitialPolicy(Protocol):
    """Produces the safetensors file of the policy both arms start from (version 0).
    The file's name is the lineage: a checkpoint from another initial policy is never
    resumed. Called by every trainer rank; it must be safe to call concurrently."""

    def __call__(self, state_dir: Path, policy_config: PolicyConfig, seed: int) -> Path: ...


class SuiteFactory(Protocol):
    """Builds the eval gate's suite (trainer.evaluation.Suite)."""

    def __call__(self, tasks: int, max_new_tokens: int) -> Suite: ...


class NoPolicyError(ValueError):
    """Neither a model directory nor an initial-policy plug-in was named."""


def initial_policy(settings: TrainerSettings) -> InitialPolicy:
    if not settings.initial_policy:
        raise NoPolicyError(
            "no policy to train: set RTRL_MODEL_DIR (a Hugging Face model directory) or "
            "RTRL_TRAINER_INITIAL_POLICY (a plug-in module:callable)"
        )
    return cast(InitialPolicy, plugins.load(settings.initial_policy))


def eval_suite(settings: TrainerSettings) -> Suite:
    factory = cast(SuiteFactory, plugins.load(settings.eval_suite))
    return factory(settings.eval_tasks, settings.eval_max_new_tokens)
