"""The engine serves any Hugging Face causal LM: the Llama family (llama, mistral, qwen2,
qwen3) on its lean forward, anything else (qwen3_moe, gpt2) through transformers'. Each
checks the engine's per-token log-probs against one transformers forward over prompt
and completion, on a tiny random checkpoint with its BPE tokenizer and chat template."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
)

from rtrl.inference.engine import Engine, EngineConfig
from rtrl.inference.records import VersionSpan, version_spans
from rtrl.ops.tiny_model import tiny_config, write_tiny_checkpoint
from rtrl.policy import ModelSpec, load_weights, state_dict_fp32

torch.set_num_threads(1)

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gpt2")
MESSAGES = (
    "Please rename the variable.",
    "hi",
    "Why did you change the indentation? Use two spaces here, and keep the tests passing.",
)


@dataclass(frozen=True)
class Checkpoint:
    family: str
    config: PretrainedConfig
    model: PreTrainedModel
    """The reference: the checkpoint as transformers loads it (float32), norms and biases perturbed."""
    weights: dict[str, torch.Tensor]
    """``model``'s weights as a trainer stages them (state_dict_fp32)."""
    prompts: tuple[list[int], ...]
    """MESSAGES rendered by the checkpoint's chat template."""
    decode: Callable[[Sequence[int]], str]
    """The tokenizer's ids to text."""

    @property
    def spec(self) -> ModelSpec:
        return ModelSpec.from_hf_config(self.config)


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory) -> Checkpoint:
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # The checkpoint's norms are ones and its biases zeros: move them, so folding them
    # into the lean forward's matrices is tested.
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
    prompts = tuple(
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": m}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        for m in MESSAGES
    )
    return Checkpoint(
        request.param,
        AutoConfig.from_pretrained(path),
        model,
        state_dict_fp32(model),
        prompts,
        lambda ids: str(tokenizer.decode(list(ids), skip_special_tokens=True)),
    )


def engine(checkpoint: Checkpoint, on_step=None, **config) -> Engine:
    """An engine (not started) serving the checkpoint's weights as version 0 of "control"."""
    eng = Engine(
        EngineConfig(hf_config=checkpoint.config, decode=checkpoint.decode, **config),
        on_step=on_step,
    )
    eng.stage("control", 0, checkpoint.weights)
    return eng


def logprobs_of(logits: torch.Tensor, tokens: Sequence[int]) -> torch.Tensor:
    """log p(tokens[i]) under logits[i] (temperature 1, whole vocabulary)."""
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def forward_logits(model: PreTrainedModel, prompt: list[int], completion: Sequence[int]):
    """The logits that predict each completion token, from one forward over both."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + list(completion)])).logits[0]
    return logits[len(prompt) - 1 : -1]


def test_logprobs_match_one_transformers_forward(checkpoint):
    prompt = checkpoint.prompts[0]
    eng = engine(checkpoint).start()
    try:
        sampled = eng.generate("control", prompt, max_tokens=24, seed=3, ignore_eos=True).result
        greedy = eng.generate("control", prompt, max_tokens=12, temperature=0.0).result
    finally:
        eng.stop()
    expected = logprobs_of(
        forward_logits(checkpoint.model, prompt, sampled.token_ids), sampled.token_ids
    )
    assert len(sampled.token_ids) == 24
    torch.testing.assert_close(torch.tensor(sampled.logprobs), expected, atol=1e-5, rtol=0)
    logits = forward_logits(checkpoint.model, prompt, greedy.token_ids)
    assert list(greedy.token_ids) == logits.argmax(-1).tolist()


def test_requests_of_different_lengths_batched_together(checkpoint):
    eng = engine(checkpoint, max_batch=4)
    futures = [
        eng.submit("control", prompt, max_tokens=10 + 4 * i, seed=i, ignore_eos=True)
        for i, prompt in enumerate(checkpoint.prompts)
    ]
    eng.start()  # everything is queued before the first batch forms
    try:
        results = [f.result().result for f in futures]
    finally:
        eng.stop()
    assert eng.stats.batches == 1
    for prompt, result in zip(checkpoint.prompts, results, strict=True):
        logits = forward_logits(checkpoint.model, prompt, result.token_ids)
        torch.testing.assert_close(
            torch.tensor(result.logprobs),
            logprobs_of(logits, result.token_ids),
            atol=1e-5,
            rtol=0,
        )


@pytest.mark.parametrize("policy", ["keep", "recompute"])
def test_swap_mid_generation(checkpoint, policy):
    swap_after, n = 5, 16
    generator = torch.Generator().manual_seed(1)
    new_weights = {
        name: t + 0.05 * torch.randn(t.shape, generator=generator)
        for name, t in checkpoint.weights.items()
    }
    new_model = AutoModelForCausalLM.from_config(checkpoint.config, dtype=torch.float32).eval()
    load_weights(new_model, new_weights)

    def on_step(arm: str, generated: int) -> None:
        if generated == swap_after:
            eng.stage(arm, 1, new_weights)

    eng = engine(checkpoint, swap_policy=policy, on_step=on_step).start()
    prompt = checkpoint.prompts[1]
    try:
        result = eng.generate("control", prompt, max_tokens=n, seed=4, ignore_eos=True).result
    finally:
        eng.stop()
    assert version_spans(result.versions) == [
        VersionSpan(0, 0, swap_after),
        VersionSpan(1, swap_after, n),
    ]
    tokens = list(result.token_ids)
    before = forward_logits(checkpoint.model, prompt, tokens)[:swap_after]
    if policy == "keep":
        # The cache holds the old weights' keys/values of everything before the swap, on
        # the lean forward's SlotCache and on transformers' own cache in the fallback.
        with torch.inference_mode():
            cache = checkpoint.model(
                input_ids=torch.tensor([prompt + tokens[: swap_after - 1]]), use_cache=True
            ).past_key_values
            after = new_model(
                input_ids=torch.tensor([tokens[swap_after - 1 : -1]]), past_key_values=cache
            ).logits[0]
    else:
        after = forward_logits(new_model, prompt, tokens)[swap_after:]
    expected = logprobs_of(torch.cat([before, after]), tokens)
    torch.testing.assert_close(torch.tensor(result.logprobs), expected, atol=1e-5, rtol=0)
    if policy == "keep":
        # Kept and recomputed contexts differ: the check above tells the policies apart.
        recomputed = forward_logits(new_model, prompt, tokens)[swap_after:]
        assert (recomputed - after).abs().max() > 1e-3


def test_a_version_that_does_not_fit_is_refused(checkpoint):
    eng = Engine(EngineConfig(hf_config=checkpoint.config))
    embed, *_, last = checkpoint.weights
    wrong_shape = {**checkpoint.weights, last: torch.zeros(3, 5)}
    missing = {n: t for n, t in checkpoint.weights.items() if n != embed}
    wrong_dtype = {**checkpoint.weights, last: checkpoint.weights[last].to(torch.int32)}
    for weights, name in ((wrong_shape, last), (missing, embed), (wrong_dtype, last)):
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            eng.stage("control", 0, weights)
    assert eng.held_version("control") == -1
    assert eng.stage("control", 0, checkpoint.weights)


def test_the_engine_says_once_why_it_serves_through_transformers(checkpoint, caplog):
    with caplog.at_level(logging.WARNING, logger="rtrl.inference.engine"):
        Engine(EngineConfig(hf_config=checkpoint.config))
    warnings = [r.getMessage() for r in caplog.records if r.name == "rtrl.inference.engine"]
    if checkpoint.spec.fast_path:
        assert warnings == []
    else:
        assert len(warnings) == 1 and checkpoint.spec.fast_path_refusal in warnings[0]


def test_stop_strings_are_found_in_the_tokenizers_text(checkpoint):
    prompt = checkpoint.prompts[2]
    eng = engine(checkpoint).start()
    try:
        whole = eng.generate("control", prompt, max_tokens=20, seed=8, ignore_eos=True).result
        stop = whole.text[len(whole.text) // 2 :][:2]
        cut = eng.generate(
            "control", prompt, max_tokens=20, seed=8, ignore_eos=True, stop=(stop,)
        ).result
    finally:
        eng.stop()
    assert whole.text == checkpoint.decode(whole.token_ids)
    assert cut.finish_reason == "stop" and cut.text == whole.text[: whole.text.find(stop)]


@pytest.mark.parametrize(
    "family,changes",
    [
        # head_dim apart from hidden/heads (Qwen3 0.6B: 1024 wide, 16 heads of 128).
        (
            "qwen3",
            {"head_dim": 32, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
        ),
        # Every head of q sharing one key/value head, biases on q/k/v and the output.
        ("llama", {"num_key_value_heads": 1, "attention_bias": True, "rms_norm_eps": 1e-5}),
    ],
)
def test_lean_forward_matches_transformers(family, changes):
    from rtrl.inference.model import Params, SlotCache, decode_step, prefill

    config = tiny_config(family, 384)
    for key, value in changes.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn(param.shape))
    spec = ModelSpec.from_hf_config(config)
    assert spec.fast_path, spec.fast_path_refusal
    params = Params.from_state_dict(state_dict_fp32(model), spec)
    cache = SlotCache(spec, 4)
    seqs = [[1, 5, 6, 7, 8, 9], [1, 10], [1, *range(20, 40)]]
    with torch.inference_mode():
        logits = prefill(params, cache, 0, seqs)
        after = decode_step(
            params,
            cache,
            torch.tensor([40, 41, 42]),
            torch.tensor([len(s) for s in seqs]),
            max(len(s) for s in seqs) + 1,
        )
        for row, seq in enumerate(seqs):
            alone = model(input_ids=torch.tensor([seq + [40 + row]])).logits[0]
            torch.testing.assert_close(logits[row], alone[-2], atol=1e-5, rtol=0)
            torch.testing.assert_close(after[row], alone[-1], atol=1e-5, rtol=0)
