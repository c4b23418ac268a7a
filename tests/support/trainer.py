"""Shared by the trainer's integration tests: the cached warm start, reward records
sampled from it, and a way to put them on the reward topic."""

from __future__ import annotations

import random
import shutil
import uuid
from pathlib import Path

import torch
from confluent_kafka import Producer
from transformers import LlamaForCausalLM

from rtrl import topics
from rtrl.ops.stack import DEMO_POLICY_TRAINER
from rtrl.policy import EOS, PolicyConfig, build_model, decode, load_weights
from rtrl.reward_stream.config import RewardStreamSettings
from rtrl.simulator.tasks import parse_style, random_task
from rtrl.simulator.warmstart import cache_path, ensure_warm_start, load_warm_start
from rtrl.trainer.sampling import prompt_ids, sample
from rtrl.v1 import common_pb2, reward_pb2, rollout_pb2, weights_pb2

DEMO_PLUGINS = {
    name.removeprefix("RTRL_TRAINER_").lower(): value for name, value in DEMO_POLICY_TRAINER.items()
}
"""The demo's plug-ins as TrainerSettings fields, as the embedded stack names them (a trainer
names none of its own): for a Trainer built in a test on the demo policy and its suite."""

REPO = Path(__file__).resolve().parents[2]


def install_warm_start(state_dir: Path) -> Path:
    """Copy the repository's cached warm start (trained once, ~1 min) into a test's state dir."""
    cached = ensure_warm_start(REPO / ".rtrl")
    target = cache_path(state_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(cached, target, dirs_exist_ok=True)
    return target


def warm_model() -> LlamaForCausalLM:
    model = build_model(PolicyConfig())
    load_weights(model, load_warm_start(ensure_warm_start(REPO / ".rtrl")))
    model.eval()
    return model


def never_fetch(arm: str, version: int) -> tuple[weights_pb2.Manifest, dict[str, torch.Tensor]]:
    """The fetch_weights of a trainer that must not resume from published weights."""
    raise AssertionError(f"the trainer fetched {arm} v{version}")


def sampled_rollouts(
    model: torch.nn.Module, tasks: int, seed: int
) -> list[tuple[str, list[int], list[int], list[float], bool]]:
    """(prompt text, prompt ids, completion ids, log-probs, well formed) sampled at temperature 1."""
    rng = random.Random(seed)
    chosen = [random_task(rng) for _ in range(tasks)]
    prompts = [prompt_ids(task.prompt) for task in chosen]
    out = sample(model, prompts, temperature=1.0, generator=torch.Generator().manual_seed(seed))
    rows = []
    for task, ids, completion in zip(chosen, prompts, out, strict=True):
        ended = completion.completion_ids[-1] == EOS
        well_formed = (
            ended and parse_style(task, decode(list(completion.completion_ids))) is not None
        )
        rows.append(
            (
                task.prompt,
                ids,
                list(completion.completion_ids),
                list(completion.logprobs),
                well_formed,
            )
        )
    return rows


def reward_record(
    prompt_text: str,
    prompt: list[int],
    completion: list[int],
    logprobs: list[float],
    reward: float,
    *,
    version: int = 0,
) -> reward_pb2.RewardRecord:
    rollout_id = str(uuid.uuid4())
    rollout = rollout_pb2.RolloutRecord(
        event_id=rollout_id,
        rollout_id=rollout_id,
        arm=common_pb2.ARM_TREATMENT,
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        completion_logprobs=logprobs,
        version_spans=[
            rollout_pb2.VersionSpan(start=0, end=len(completion), policy_version=version)
        ],
        sampling=rollout_pb2.SamplingParams(temperature=1.0),
        prompt_text=prompt_text,
    )
    return reward_pb2.RewardRecord(
        reward_id=f"r-{rollout_id}",
        rollout_id=rollout_id,
        rollout=rollout,
        reward=reward,
        last_event_ts_ms=1,
    )


def produce(
    bootstrap: str,
    records: list[reward_pb2.RewardRecord],
    topic: str = topics.REWARD,
    *,
    signed: bool = True,
) -> None:
    """Write reward records as the joiner would: sealed with the run's joiner keys (conftest.py)."""
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    signer = RewardStreamSettings().reward_seal()
    for record in records:
        value = record.SerializeToString()
        producer.produce(
            topic,
            value,
            key=record.rollout_id.encode(),
            headers=list(signer.headers(value)) if signed else None,
        )
        producer.poll(0)
    if producer.flush(30) != 0:
        raise RuntimeError("reward records not acknowledged within 30 s")


def trainer_env(
    stack_env: dict[str, str], weight_sync_addr: str, repo_root: Path
) -> dict[str, str]:
    """The environment of a trainer process (`python -m rtrl.trainer`) for the fault tests:
    small batches, every candidate judged and none refused (those tests are about
    delivery and recovery; test_eval_gate is about refusals)."""
    return {
        **stack_env,
        **DEMO_POLICY_TRAINER,
        "PYTHONPATH": str(repo_root),
        "RTRL_WEIGHT_SYNC_ADDR": weight_sync_addr,
        "RTRL_TRAINER_BATCH_SIZE": "16",
        "RTRL_TRAINER_MIN_BATCH": "1",
        "RTRL_TRAINER_MAX_WAIT_S": "0.3",
        "RTRL_TRAINER_MAX_STALENESS": "1000",
        "RTRL_TRAINER_CHECKPOINT_EVERY": "7",
        "RTRL_TRAINER_EVAL_TASKS": "16",
        "RTRL_TRAINER_EVAL_TOLERANCE": "1.0",
        "OMP_NUM_THREADS": "1",
    }


TINY_AGENT = PolicyConfig(
    hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, max_positions=256
)
"""The demo agent's shape, shrunk: enough for the loop to carry, cheap to warm-start."""


def tiny_agent_warm_start() -> Path:
    """The demo agent's warm start on TINY_AGENT for a few hundred steps (cached in the
    repository's .rtrl, trained once, ~20 s): it calls tools wastefully and writes helpers
    badly, which is all the loop needs to carry."""
    from rtrl.simulator.agent_warmstart import AgentRecipe

    recipe = AgentRecipe(batch_size=16, min_steps=250, max_steps=250, lr=3e-3, warmup_steps=20)
    return ensure_warm_start(REPO / ".rtrl", policy_config=TINY_AGENT, recipe=recipe)


def install_tiny_agent_as_demo_agent(state_dir: Path) -> Path:
    """Put the tiny agent where `rtrl demo` (the agentic product) finds its warm start in
    ``state_dir``'s cache, so the real CLI runs without training the real one for minutes."""
    from rtrl.simulator.agent_warmstart import AGENT_POLICY, AgentRecipe
    from rtrl.trainer.config import TrainerSettings

    target = cache_path(state_dir, AGENT_POLICY, AgentRecipe(seed=TrainerSettings().seed))
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(tiny_agent_warm_start(), target)
    return target
