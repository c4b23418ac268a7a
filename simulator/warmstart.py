"""Supervised warm start: a policy that writes well-formed helpers in a random style.

Completions are rendered in a uniformly random style, independent of the project
tag, so the warm-started policy is plausible but not good: about 50/50 on indent
and quote whatever the project. Learning each project's house style is left to RL.

Each batch holds batch_size / 4 tasks, each rendered in all four styles. The style
marginals are then exactly uniform per batch, and the gradients on the opening
quote and indent (pure 50/50 choices) cancel within the batch instead of drowning
the one thing that is slow to learn: closing the string with the quote it was
opened with (a copy across the word, learnt in a sudden transition after a few
hundred steps; uniform per-example styles made that transition several times later
and much less predictable across seeds).

A small auxiliary head (discarded afterwards) predicts the project from the last
hidden state at every completion position. Since nothing in the warm-start data
depends on the project, the policy would otherwise learn to carry almost nothing
of the tag to where the style is decided, and RL could not make the style
project-specific: measured at lr 1e-4, batch 64, the house-style keep rate did not
move in 80 steps without the head and went 0.23 → 0.96 with it. A pretrained
model keeps its context salient anyway; this stands in for that. It changes no
output distribution: styles stay ~50/50 per project.

A few rows of each batch (question_rows, 4 of 64) are a clarifying question
about the project's style instead of a helper (simulator.tasks.Task.question), so
the warm-started policy asks about 6 % of the time, whatever the project. Its
first token ("w") differs from a helper's ("d"), so reward can move that choice
as fast as a style choice: what it does with it depends on whether the reward
function pays for not editing (reward_stream/reward.py, r1 vs r3).

Training stops once sampled completions are well formed (a parsing helper or one
of the questions; target_parse_rate), checked every eval_every steps, so the run is
as short as the seed allows and deterministic.
"""

from __future__ import annotations

import fcntl
import hashlib
import inspect
import json
import math
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import rtrl.policy
import rtrl.simulator.tasks
import rtrl.trainer.sampling
from rtrl.checkpoint import DEMO_CHAT_TEMPLATE, write_demo_checkpoint
from rtrl.policy import EOS, PAD, PolicyConfig, build_model, decode, encode, state_dict_fp32
from rtrl.simulator.tasks import (
    MIXED_PROJECT,
    PROJECT_STYLES,
    PROJECTS,
    QUESTION_TOPICS,
    UNIQUE_MAX_TOKENS,
    Task,
    parse_style,
    random_task,
    with_random_serial,
)
from rtrl.trainer.sampling import prompt_ids, sample

Progress = Callable[[int, int, float], None]


@dataclass(frozen=True)
class WarmStartRecipe:
    batch_size: int = 64
    """Sequences per step; with question_rows taken out, a multiple of the four styles."""
    question_rows: int = 4
    """Rows per batch holding a clarifying question instead of a helper."""
    mixed_question_share: float = 0.75
    """Share of the question rows asked in the mixed project (p4), where asking is
    most natural: about 20 % of p4 completions ask, 2 % elsewhere."""
    lr: float = 1e-3
    """AdamW learning rate after warm-up (2e-3 delayed the quote-copy transition)."""
    warmup_steps: int = 50
    min_steps: int = 200
    max_steps: int = 1500
    eval_every: int = 100
    eval_samples: int = 100
    target_parse_rate: float = 0.95
    """Stop when this share of sampled completions (temperature 1) parses or is a question."""
    context_aux_weight: float = 0.1
    """Weight of the auxiliary project-prediction loss (0 disables it)."""
    unique_prompts: bool = False
    """Every task carries a random serial (simulator.tasks.Task.serial), as in the product's
    unique-prompts mode: the policy learns to copy an identifier it has never seen."""
    seed: int = 0

    def __post_init__(self) -> None:
        helpers = self.batch_size - self.question_rows
        if self.question_rows < 0 or helpers <= 0 or helpers % len(PROJECT_STYLES):
            raise ValueError(
                f"batch_size {self.batch_size} minus question_rows {self.question_rows} "
                f"is not a positive multiple of {len(PROJECT_STYLES)} styles"
            )

    chat_template = DEMO_CHAT_TEMPLATE

    def batch(self, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _batch(rng, self)

    def lr_at(self, step: int) -> float:
        return warmed_up_lr(self.lr, self.warmup_steps, step)

    def ready(self, model: torch.nn.Module, step: int) -> bool:
        return _well_formed(model, self, step)

    def quality(self, model: torch.nn.Module) -> PolicyQuality:
        return measure(model, unique_prompts=self.unique_prompts)

    def sources(self) -> list[Path]:
        modules = (rtrl.simulator.tasks, rtrl.policy, rtrl.trainer.sampling)
        return [Path(inspect.getfile(m)) for m in modules] + [Path(__file__)]


class Curriculum(Protocol):
    """What a warm start trains on (WarmStartRecipe; the agent's: simulator/agent_warmstart.py)."""

    @property
    def max_steps(self) -> int: ...
    @property
    def context_aux_weight(self) -> float: ...
    @property
    def seed(self) -> int: ...
    @property
    def chat_template(self) -> str: ...

    def batch(self, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token ids [B, L], completion-target mask [B, L-1], project of each row [B]."""
        ...

    def lr_at(self, step: int) -> float:
        """The learning rate of step ``step`` (from 0)."""
        ...

    def ready(self, model: torch.nn.Module, step: int) -> bool:
        """Whether training may stop after ``step``."""
        ...

    def quality(self, model: torch.nn.Module) -> Any:
        """How the trained policy does (a dataclass, kept in warmstart.json)."""
        ...

    def sources(self) -> list[Path]:
        """The files whose code defines what it trains (part of the cache key)."""
        ...


def warmed_up_lr(lr: float, warmup_steps: int, step: int) -> float:
    """``lr`` after a linear warm-up over ``warmup_steps``."""
    return lr * min(1.0, (step + 1) / warmup_steps)


@dataclass(frozen=True)
class PolicyQuality:
    samples: int
    parse_rate: float
    """Share of completions parse_style() accepts."""
    question_rate: float
    """Share of completions that are exactly one of the task's clarifying questions."""
    single_quote_by_project: tuple[float, ...]
    """Among parsed completions of each project, the share using ' quotes."""
    indent2_by_project: tuple[float, ...]
    """Among parsed completions of each project, the share indented by 2."""


@dataclass(frozen=True)
class WarmStartStats:
    steps: int
    seconds: float
    final_loss: float
    quality: Any


def cache_key(policy_config: PolicyConfig, recipe: Curriculum) -> str:
    """Changes with the model shape, the recipe (seed included) and the code that
    defines the task, the model, the sampler used for stopping, and this file."""
    digest = hashlib.sha256()
    digest.update(policy_config.fingerprint().encode())
    digest.update(repr(recipe).encode())
    for source in recipe.sources():
        digest.update(hashlib.sha256(source.read_bytes()).digest())
    return digest.hexdigest()[:16]


def cache_path(
    state_dir: Path,
    policy_config: PolicyConfig = PolicyConfig(),
    recipe: Curriculum = WarmStartRecipe(),
) -> Path:
    """The warm start's model directory (rtrl.checkpoint: config, weights, tokenizer)."""
    return Path(state_dir) / "cache" / f"warmstart-{cache_key(policy_config, recipe)}"


@torch.no_grad()
def measure(
    model: torch.nn.Module,
    samples: int = 200,
    seed: int = 1,
    temperature: float = 1.0,
    unique_prompts: bool = False,
) -> PolicyQuality:
    """Sample completions for random tasks (with serials if ``unique_prompts``) and judge
    them with parse_style()."""
    rng = random.Random(seed)
    tasks = [random_task(rng) for _ in range(samples)]
    if unique_prompts:
        tasks = [with_random_serial(task, rng) for task in tasks]
    was_training = model.training
    model.eval()
    out = sample(
        model,
        [prompt_ids(t.prompt) for t in tasks],
        temperature=temperature,
        max_new_tokens=UNIQUE_MAX_TOKENS if unique_prompts else 48,
        generator=torch.Generator().manual_seed(seed),
    )
    model.train(was_training)
    projects = PROJECTS
    parsed = [0] * projects
    single = [0] * projects
    indent2 = [0] * projects
    questions = 0
    for task, completion in zip(tasks, out, strict=True):
        text = decode(list(completion.completion_ids))
        ended = completion.completion_ids[-1] == EOS
        questions += ended and text in {task.question(topic) for topic in QUESTION_TOPICS}
        style = parse_style(task, text)
        if style is None or not ended:
            continue
        parsed[task.project] += 1
        single[task.project] += style.quote == "'"
        indent2[task.project] += style.indent == 2
    return PolicyQuality(
        samples=samples,
        parse_rate=sum(parsed) / samples,
        question_rate=questions / samples,
        single_quote_by_project=tuple(s / max(p, 1) for s, p in zip(single, parsed, strict=True)),
        indent2_by_project=tuple(s / max(p, 1) for s, p in zip(indent2, parsed, strict=True)),
    )


def batch_rows(rng: random.Random, recipe: WarmStartRecipe) -> list[tuple[Task, str]]:
    """One batch of (task, completion text): each helper task in all four styles, then
    the question rows."""
    rows: list[tuple[Task, str]] = []
    for _ in range((recipe.batch_size - recipe.question_rows) // len(PROJECT_STYLES)):
        task = random_task(rng)
        if recipe.unique_prompts:
            task = with_random_serial(task, rng)
        rows.extend((task, task.render(style)) for style in PROJECT_STYLES)
    for i in range(recipe.question_rows):
        mixed = rng.random() < recipe.mixed_question_share
        task = random_task(
            rng, project=MIXED_PROJECT if mixed else rng.randrange(len(PROJECT_STYLES))
        )
        if recipe.unique_prompts:
            task = with_random_serial(task, rng)
        rows.append((task, task.question(QUESTION_TOPICS[i % len(QUESTION_TOPICS)])))
    return rows


def _batch(
    rng: random.Random, recipe: WarmStartRecipe
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids [B, L], completion-target mask [B, L-1], project of each row [B]."""
    sequences, masks, projects = [], [], []
    for task, text in batch_rows(rng, recipe):
        projects.append(task.project)
        prompt = prompt_ids(task.prompt)
        completion = encode(text) + [EOS]
        sequences.append(prompt + completion)
        masks.append([0.0] * (len(prompt) - 1) + [1.0] * len(completion))
    width = max(map(len, sequences))
    ids = torch.tensor([s + [PAD] * (width - len(s)) for s in sequences])
    mask = torch.tensor([m + [0.0] * (width - 1 - len(m)) for m in masks])
    return ids, mask, torch.tensor(projects)


def train(
    policy_config: PolicyConfig = PolicyConfig(),
    recipe: Curriculum = WarmStartRecipe(),
    progress: Progress | None = None,
) -> tuple[torch.nn.Module, WarmStartStats]:
    """Teacher-forced cross-entropy on completion tokens (and EOS) only."""
    started = time.monotonic()
    model = build_model(policy_config, seed=recipe.seed)
    model.train()
    project_head = torch.nn.Linear(policy_config.hidden_size, PROJECTS)
    parameters = [*model.parameters(), *project_head.parameters()]
    optimizer = torch.optim.AdamW(
        parameters, lr=recipe.lr_at(0), betas=(0.9, 0.98), weight_decay=0.0
    )
    rng = random.Random(recipe.seed)
    step, loss_value = 0, math.nan
    while step < recipe.max_steps:
        for group in optimizer.param_groups:
            group["lr"] = recipe.lr_at(step)
        loss, total = _losses(model, project_head, *recipe.batch(rng), recipe.context_aux_weight)
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        loss_value = loss.item()
        if progress is not None:
            progress(step, recipe.max_steps, loss_value)
        if recipe.ready(model, step):
            break
    if progress is not None and step < recipe.max_steps:
        progress(recipe.max_steps, recipe.max_steps, loss_value)
    model.eval()
    seconds = time.monotonic() - started
    return model, WarmStartStats(
        steps=step,
        seconds=seconds,
        final_loss=loss_value,
        quality=recipe.quality(model),
    )


def _losses(
    model: torch.nn.Module,
    project_head: torch.nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor,
    projects: torch.Tensor,
    aux_weight: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cross-entropy of the completion tokens, and what a step minimises: that plus,
    with ``aux_weight``, the project head's loss at the same positions."""
    outputs = model(input_ids=ids, output_hidden_states=aux_weight > 0)
    logits = outputs.logits[:, :-1]
    token_loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
    )
    loss = (token_loss.view(mask.shape) * mask).sum() / mask.sum()
    total = loss
    if aux_weight > 0:
        project_logits = project_head(outputs.hidden_states[-1][:, :-1])
        targets = projects[:, None].expand(mask.shape)
        aux = F.cross_entropy(
            project_logits.reshape(-1, PROJECTS), targets.reshape(-1), reduction="none"
        )
        total = loss + aux_weight * (aux.view(mask.shape) * mask).sum() / mask.sum()
    return loss, total


def _well_formed(model: torch.nn.Module, recipe: WarmStartRecipe, step: int) -> bool:
    """At an evaluation step, whether sampled completions are well formed enough to stop."""
    if step < recipe.min_steps or step % recipe.eval_every != 0:
        return False
    quality = measure(
        model,
        recipe.eval_samples,
        seed=recipe.seed + 1,
        unique_prompts=recipe.unique_prompts,
    )
    return quality.parse_rate + quality.question_rate >= recipe.target_parse_rate


def ensure_warm_start(
    state_dir: Path,
    progress: Progress | None = None,
    *,
    policy_config: PolicyConfig = PolicyConfig(),
    recipe: Curriculum = WarmStartRecipe(),
    threads: int | None = None,
) -> Path:
    """The cached warm-start policy as a model directory, trained first if missing, on
    ``threads`` (default: torch's own setting, OMP_NUM_THREADS or one per core).

    A file lock keeps two processes (the CLI and the trainer) from training the
    same weights at once; the directory appears atomically (a rename), so a reader
    never sees half.
    """
    path = cache_path(state_dir, policy_config, recipe)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return path
        previous_threads = torch.get_num_threads()
        torch.set_num_threads(threads or previous_threads)
        try:
            model, stats = train(policy_config, recipe, progress)
        finally:
            torch.set_num_threads(previous_threads)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        write_demo_checkpoint(tmp, state_dict_fp32(model), policy_config, recipe.chat_template)
        metadata = {"cache_key": cache_key(policy_config, recipe), "stats": asdict(stats)}
        (tmp / "warmstart.json").write_text(json.dumps(metadata, indent=1))
        os.replace(tmp, path)
    return path


def load_warm_start(path: Path) -> dict[str, torch.Tensor]:
    """The warm start's weights (tied ones once, as rtrl.policy.state_dict_fp32 lists them)."""
    return load_file(str(path / "model.safetensors"))


def demo_policy(state_dir: Path, policy_config: PolicyConfig, seed: int) -> Path:
    """The trainer's default initial policy (trainer.plugins.InitialPolicy)."""
    return ensure_warm_start(
        state_dir, policy_config=policy_config, recipe=WarmStartRecipe(seed=seed)
    )


def unique_prompt_policy(state_dir: Path, policy_config: PolicyConfig, seed: int) -> Path:
    """The initial policy of the unique-prompts demo (``rtrl demo --unique-prompts``): the
    demo policy warm-started on tasks with serials."""
    return ensure_warm_start(
        state_dir,
        policy_config=policy_config,
        recipe=WarmStartRecipe(seed=seed, unique_prompts=True),
    )


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(
        description="Train the warm start (uncached) and print its quality."
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--unique-prompts", action="store_true", help="tasks with serials (unique_prompt_policy)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    recipe = WarmStartRecipe(seed=args.seed, unique_prompts=args.unique_prompts)

    def report(step: int, total: int, loss: float) -> None:
        if step % 50 == 0:
            print(f"step {step:5d}/{total}  loss {loss:.4f}", flush=True)

    _, stats = train(PolicyConfig(), recipe, report)
    q = stats.quality
    print(f"steps {stats.steps}  time {stats.seconds:.1f} s  final loss {stats.final_loss:.4f}")
    print(
        f"parse rate {q.parse_rate:.3f}, question rate {q.question_rate:.3f} "
        f"over {q.samples} samples at temperature 1.0"
    )
    for project in range(PROJECTS):
        house = (
            PROJECT_STYLES[project]
            if project < len(PROJECT_STYLES)
            else "none: each user has their own"
        )
        print(
            f"  project {project}: single quote {q.single_quote_by_project[project]:.2f}  "
            f"indent 2 {q.indent2_by_project[project]:.2f}  (house style {house})"
        )


if __name__ == "__main__":
    main()
