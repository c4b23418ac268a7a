"""The eval gate for a model of your own when you name no suite: one that needs no labels.

The initial policy answers a fixed set of held-out prompts once (sampled, seeded); a
candidate is scored by how likely it still finds those answers: ``kl_to_initial`` =
exp(−(NLL_candidate − NLL_initial)), the per-token negative log-likelihood difference
over the answers' tokens, a Monte Carlo estimate of exp(−KL(initial ‖ candidate)). The
initial policy scores 1.0; a candidate that moved far from what the product served
scores near 0. With the gate's tolerance t, a candidate is refused once its estimated
KL to the initial policy exceeds −ln(1 − t) nats per token (0.105 at t = 0.1) or it
falls more than t below the published version: an update that wrecks the model (a
learning rate ten times too high collapses it in a step) never ships, however its
rewards looked.

It knows nothing of quality: a suite of your own (RTRL_TRAINER_EVAL_SUITE) with real
checkers is better when you have one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from rtrl.checkpoint import Checkpoint
from rtrl.trainer.evaluation import EvalScores

PROMPTS = (
    "Write a function that returns the sum of a list.",
    "Rename the variable `tmp` to something clearer.",
    "Why does this loop never end? while i < 10: print(i)",
    "Add type hints to: def area(w, h): return w * h",
    "Explain what a race condition is in one sentence.",
    "Fix the indentation of this block.",
    "Make this function handle an empty input.",
    "Write a docstring for a function that parses dates.",
)
"""Held-out prompts in the shape of a coding assistant's traffic (chat messages when the
checkpoint has a chat template, plain prompts otherwise)."""

CHECKER = "kl_to_initial"


class LabelFreeSuite:
    """A trainer.evaluation.Suite scoring candidates against the initial policy's answers."""

    checkers = (CHECKER,)

    def __init__(
        self,
        policy: Checkpoint,
        initial: torch.nn.Module,
        *,
        samples: int = 16,
        max_new_tokens: int = 32,
        seed: int = 0,
    ) -> None:
        prompts = [_prompt_ids(policy, PROMPTS[i % len(PROMPTS)]) for i in range(samples)]
        self.sequences = [
            sample_answer(initial, ids, max_new_tokens, policy.eos_token_ids, seed + i)
            for i, ids in enumerate(prompts)
        ]
        self.reference_nll = self._nll(initial)

    @torch.no_grad()
    def score(self, model: torch.nn.Module) -> EvalScores:
        gap = self._nll(model) - self.reference_nll
        return EvalScores({CHECKER: math.exp(-max(gap, 0.0))}, samples=len(self.sequences))

    @torch.no_grad()
    def _nll(self, model: torch.nn.Module) -> float:
        """Mean negative log-likelihood per answer token, over every held-out answer."""
        was_training = model.training
        model.eval()
        total, tokens = 0.0, 0
        for prompt_len, ids in self.sequences:
            logits = model(torch.tensor([ids])).logits[0, prompt_len - 1 : -1].float()
            answer = torch.tensor(ids[prompt_len:])
            total -= torch.log_softmax(logits, -1).gather(1, answer[:, None]).sum().item()
            tokens += len(answer)
        model.train(was_training)
        return total / max(tokens, 1)


def _prompt_ids(policy: Checkpoint, text: str) -> list[int]:
    if policy.tokenizer.chat_template:
        return policy.render_chat([{"role": "user", "content": text}])
    return policy.encode(text)


@torch.no_grad()
def sample_answer(
    model: torch.nn.Module,
    prompt: Sequence[int],
    max_new_tokens: int,
    eos: Sequence[int],
    seed: int,
) -> tuple[int, list[int]]:
    """(prompt length, prompt + a sampled answer of at least one token).

    The prompt runs once and each sampled token once after it, on the model's KV cache:
    a gate that samples long answers pays for their tokens, not their square."""
    generator = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    outputs = model(torch.tensor([ids]), use_cache=True)
    for step in range(max_new_tokens):
        logits = outputs.logits[0, -1].float()
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        ids.append(token)
        if token in eos or step == max_new_tokens - 1:
            break
        outputs = model(
            torch.tensor([[token]]), past_key_values=outputs.past_key_values, use_cache=True
        )
    return len(prompt), ids
