"""The inference engine: sampling log-probs, continuous batching, seeds, and swaps between decode steps."""

import threading

import pytest
import torch

from rtrl.inference.arms import assign_arm
from rtrl.inference.engine import ArmNotReady, Engine, EngineConfig, prompt_token_ids
from rtrl.inference.records import VersionSpan, version_spans
from rtrl.inference.sampling import sample, sampling_logprobs
from rtrl.policy import build_model, encode, state_dict_fp32

torch.set_num_threads(1)

PROMPTS = ["@p0 say hi\n", "@p3 warn ready\n", "x\n", "@p2 show saved and a much longer prompt\n"]


def weights(seed: int) -> dict[str, torch.Tensor]:
    return state_dict_fp32(build_model(seed=seed))


def engine(config: EngineConfig = EngineConfig(), **kwargs) -> Engine:
    """An engine (not started) whose arms hold weights from seeds 1 (control) and 2 (treatment)."""
    eng = Engine(config, **kwargs)
    eng.stage("control", 0, weights(1))
    eng.stage("treatment", 0, weights(2))
    return eng


@pytest.fixture
def started():
    eng = engine().start()
    yield eng
    eng.stop()


def full_forward_logprobs(
    model_seed: int, prompt_ids, completion, temperature: float, top_p: float = 1.0
) -> torch.Tensor:
    """log p(completion[i]) from one forward pass over the whole sequence."""
    model = build_model(seed=model_seed)
    ids = torch.tensor([list(prompt_ids) + list(completion)])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1]
    n = len(completion)
    logp = sampling_logprobs(logits, torch.full((n,), temperature), torch.full((n,), top_p))
    return logp.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1)


def test_same_seed_same_rollout_across_engines(started):
    ids = prompt_token_ids(PROMPTS[0])
    first = started.generate("control", ids, max_tokens=24, seed=11).result
    other = engine().start()
    try:
        again = other.generate("control", ids, max_tokens=24, seed=11).result
    finally:
        other.stop()
    different = started.generate("control", ids, max_tokens=24, seed=12).result
    assert first == again
    assert first.token_ids != different.token_ids


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8)])
def test_logprobs_match_full_sequence_forward(started, temperature, top_p):
    ids = prompt_token_ids(PROMPTS[1])
    completion = started.generate(
        "treatment", ids, max_tokens=30, temperature=temperature, top_p=top_p, seed=3
    )
    result = completion.result
    expected = full_forward_logprobs(2, ids, result.token_ids, temperature, top_p)
    torch.testing.assert_close(torch.tensor(result.logprobs), expected, atol=1e-4, rtol=0)
    assert completion.params.max_tokens == 30 and len(result.token_ids) <= 30
    assert result.versions == (0,) * len(result.token_ids)


def test_greedy_is_argmax_with_zero_logprob(started):
    result = started.generate(
        "control", prompt_token_ids(PROMPTS[0]), max_tokens=12, temperature=0.0
    ).result
    assert all(abs(lp) < 1e-4 for lp in result.logprobs)
    assert (
        result
        == started.generate(
            "control", prompt_token_ids(PROMPTS[0]), max_tokens=12, temperature=0.0, seed=5
        ).result
    )


def test_a_batch_matches_each_prompt_alone():
    batched = engine(EngineConfig(max_batch=8))
    futures = [
        batched.submit("control", prompt_token_ids(p), max_tokens=25, seed=i)
        for i, p in enumerate(PROMPTS)
    ]
    batched.start()  # everything is queued before the first batch forms
    together = [f.result().result for f in futures]
    batched.stop()
    assert batched.stats.batches == 1
    alone_engine = engine(EngineConfig(max_batch=1)).start()
    try:
        for i, p in enumerate(PROMPTS):
            alone = alone_engine.generate(
                "control", prompt_token_ids(p), max_tokens=25, seed=i
            ).result
            assert alone.token_ids == together[i].token_ids
            torch.testing.assert_close(
                torch.tensor(alone.logprobs), torch.tensor(together[i].logprobs), atol=1e-4, rtol=0
            )
    finally:
        alone_engine.stop()


@pytest.mark.guarantee(3)
@pytest.mark.parametrize("policy", ["keep", "recompute"])
def test_swap_between_decode_steps(policy):
    swap_after = 5
    new_weights = weights(7)

    def on_step(arm: str, generated: int) -> None:
        if generated == swap_after:
            eng.stage(arm, 1, new_weights)

    eng = engine(EngineConfig(swap_policy=policy), on_step=on_step).start()
    ids = prompt_token_ids(PROMPTS[0])
    try:
        completion = eng.generate("treatment", ids, max_tokens=20, temperature=0.9, seed=4)
    finally:
        eng.stop()
    result = completion.result
    assert len(result.token_ids) == 20
    assert version_spans(result.versions) == [
        VersionSpan(0, 0, swap_after),
        VersionSpan(1, swap_after, 20),
    ]
    assert eng.versions()["treatment"] == 1 and eng.stats.swaps == 3

    old, new = build_model(seed=2), build_model(seed=7)
    tokens = list(result.token_ids)
    with torch.inference_mode():
        before = old(input_ids=torch.tensor([ids + tokens[:swap_after]])).logits[0, len(ids) - 1 :]
        if policy == "keep":
            # The cache holds the old weights' keys/values of everything before the swap.
            cache = old(
                input_ids=torch.tensor([ids + tokens[: swap_after - 1]]), use_cache=True
            ).past_key_values
            after = new(
                input_ids=torch.tensor([tokens[swap_after - 1 : -1]]), past_key_values=cache
            ).logits[0]
        else:
            after = new(input_ids=torch.tensor([ids + tokens[:-1]])).logits[
                0, len(ids) - 1 + swap_after :
            ]
    logits = torch.cat([before[:swap_after], after])
    n = len(tokens)
    expected_tokens, expected_logprobs = zip(
        *(
            sample(
                logits[t : t + 1], torch.tensor([0.9]), torch.tensor([1.0]), torch.tensor([4]), t
            )
            for t in range(n)
        ),
        strict=True,
    )
    assert tokens == [int(t) for t in expected_tokens]
    torch.testing.assert_close(
        torch.tensor(result.logprobs), torch.cat(expected_logprobs), atol=1e-4, rtol=0
    )


def test_model_matches_transformers_forward():
    # The lean forward (inference/model.py) against LlamaForCausalLM, prefill and decode.
    from rtrl.inference.model import Params, SlotCache, decode_step, prefill

    hf = build_model(seed=3)
    params = Params.from_state_dict(state_dict_fp32(hf))
    cache = SlotCache(params.spec, 4)
    seqs = [prompt_token_ids(p) for p in PROMPTS[:3]]
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
            torch.testing.assert_close(
                logits[row], hf(input_ids=torch.tensor([seq])).logits[0, -1], atol=1e-5, rtol=0
            )
            torch.testing.assert_close(
                after[row],
                hf(input_ids=torch.tensor([seq + [40 + row]])).logits[0, -1],
                atol=1e-5,
                rtol=0,
            )


def test_requests_join_a_running_batch_and_match_running_alone():
    # Continuous batching: requests arriving while others decode join at a step boundary
    # (no second batch waits for the first to drain), and each samples what it would alone.
    joined = threading.Event()

    def on_step(arm: str, generated: int) -> None:
        if generated == 3 and not joined.is_set():
            joined.set()
            late.extend(
                eng.submit("control", prompt_token_ids(p), max_tokens=20, seed=10 + i)
                for i, p in enumerate(PROMPTS[1:])
            )

    late: list = []
    eng = engine(EngineConfig(max_batch=8), on_step=on_step).start()
    try:
        first = eng.generate(
            "control", prompt_token_ids(PROMPTS[0]), max_tokens=30, seed=9, ignore_eos=True
        )
        others = [f.result().result for f in late]
        assert eng.stats.batches == 2 and eng.stats.steps < 30 + 20  # the late ones ran alongside
    finally:
        eng.stop()
    alone = engine(EngineConfig(max_batch=1)).start()
    try:
        pairs = [
            (
                alone.generate(
                    "control", prompt_token_ids(PROMPTS[0]), max_tokens=30, seed=9, ignore_eos=True
                ).result,
                first.result,
            )
        ]
        pairs += [
            (
                alone.generate("control", prompt_token_ids(p), max_tokens=20, seed=10 + i).result,
                others[i],
            )
            for i, p in enumerate(PROMPTS[1:])
        ]
        for again, batched in pairs:
            assert again.token_ids == batched.token_ids
            torch.testing.assert_close(
                torch.tensor(again.logprobs), torch.tensor(batched.logprobs), atol=1e-4, rtol=0
            )
    finally:
        alone.stop()
    assert len(first.result.token_ids) == 30 and first.result.finish_reason == "length"


def test_tokens_stream_in_order():
    eng = engine().start()
    streamed: list[tuple[int, float, int]] = []
    try:
        done = eng.generate(
            "control",
            prompt_token_ids(PROMPTS[0]),
            max_tokens=15,
            seed=2,
            on_token=lambda *t: streamed.append(t),
        )
    finally:
        eng.stop()
    assert streamed == list(
        zip(done.result.token_ids, done.result.logprobs, done.result.versions, strict=True)
    )


def echo_weights(token: int) -> dict[str, torch.Tensor]:
    """A recognisable version: whatever it reads, it emits ``token``. Every input embeds
    to the same vector, attention and MLP add nothing, and only ``token``'s row of the
    (untied) output matrix sees that vector."""
    w = weights(1)
    w["model.embed_tokens.weight"] = torch.ones_like(w["model.embed_tokens.weight"])
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = torch.zeros_like(w[name])
    head = torch.zeros_like(w["model.embed_tokens.weight"])
    head[token] = 1.0
    w["lm_head.weight"] = head
    return w


@pytest.mark.parametrize("policy", ["keep", "recompute"])
def test_served_output_switches_to_a_recognisable_version_mid_generation(policy):
    z = encode("Z")[0]
    swap_after = 6

    def on_step(arm: str, generated: int) -> None:
        if generated == swap_after:
            eng.stage(arm, 1, echo_weights(z))

    eng = engine(EngineConfig(swap_policy=policy), on_step=on_step).start()
    try:
        result = eng.generate(
            "control", prompt_token_ids(PROMPTS[1]), max_tokens=20, temperature=0.0, ignore_eos=True
        ).result
    finally:
        eng.stop()
    assert version_spans(result.versions) == [
        VersionSpan(0, 0, swap_after),
        VersionSpan(1, swap_after, 20),
    ]
    assert result.token_ids[swap_after:] == (z,) * (20 - swap_after)
    assert result.token_ids[:swap_after] != (z,) * swap_after


@pytest.mark.guarantee(3)
def test_every_token_is_sampled_by_the_whole_version_it_names():
    # Versions alternate between two unrelated weight sets, staged from another thread
    # every few milliseconds while eight requests decode. With "recompute", token t of a
    # request is sampled from the full forward of the version it names over everything
    # before it; a token attributed to the wrong version, or sampled from a mix of two
    # versions, would not have that log-prob.
    sets = {0: weights(1), 1: weights(5)}
    eng = Engine(EngineConfig(max_batch=8, swap_policy="recompute"))
    eng.stage("control", 0, sets[0])
    eng.start()
    stop = threading.Event()

    def swapper() -> None:
        version = 0
        while not stop.wait(0.004):
            version += 1
            eng.stage("control", version, sets[version % 2])

    thread = threading.Thread(target=swapper)
    thread.start()
    try:
        futures = [
            eng.submit(
                "control", prompt_token_ids(PROMPTS[i % 4]), max_tokens=40, seed=i, ignore_eos=True
            )
            for i in range(8)
        ]
        completions = [f.result(timeout=60) for f in futures]
    finally:
        stop.set()
        thread.join()
        eng.stop()
    models = {k: build_model(seed=s) for k, s in ((0, 1), (1, 5))}
    switches = 0
    for c in completions:
        ids, tokens, versions = list(c.prompt_ids), list(c.result.token_ids), c.result.versions
        switches += len(version_spans(versions)) - 1
        with torch.inference_mode():
            full = {
                k: torch.log_softmax(
                    m(input_ids=torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1], -1
                )
                for k, m in models.items()
            }
        for t, (token, version) in enumerate(zip(tokens, versions, strict=True)):
            assert c.result.logprobs[t] == pytest.approx(
                float(full[version % 2][t, token]), abs=1e-4
            ), (t, version)
    assert switches >= 8, "the swapper should have landed inside the generations"


def test_arm_without_weights_times_out_cleanly():
    eng = Engine(EngineConfig(ready_timeout_s=0.2))
    eng.stage("control", 0, weights(1))
    eng.start()
    try:
        with pytest.raises(ArmNotReady, match="treatment"):
            eng.generate("treatment", prompt_token_ids(PROMPTS[0]), max_tokens=4)
        assert not eng.ready()
        assert eng.versions() == {"control": 0, "treatment": -1}
        assert (
            len(
                eng.generate("control", prompt_token_ids(PROMPTS[0]), max_tokens=4).result.token_ids
            )
            <= 4
        )
    finally:
        eng.stop()


def test_request_waits_for_first_weights():
    eng = Engine(EngineConfig(ready_timeout_s=30)).start()
    try:
        future = eng.submit("control", prompt_token_ids(PROMPTS[0]), max_tokens=4, seed=1)
        threading.Timer(0.1, eng.stage, ("control", 3, weights(1))).start()
        assert future.result(timeout=20).result.versions[0] == 3
    finally:
        eng.stop()


@pytest.mark.guarantee(3)
def test_stage_rejects_bad_or_stale_weights():
    eng = engine()
    bad = weights(1)
    bad["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match="wrong_shape"):
        eng.stage("control", 1, bad)
    partial = weights(1)
    del partial["model.norm.weight"]
    with pytest.raises(ValueError, match="missing"):
        eng.stage("control", 1, partial)
    assert eng.stage("control", 0, weights(1)) is False
    with pytest.raises(ValueError, match="arm"):
        eng.stage("canary", 0, weights(1))


def test_stop_string_truncates_text(started):
    ids = prompt_token_ids(PROMPTS[2])
    free = started.generate("control", ids, max_tokens=30, seed=9).result
    stop = free.text[6:8]
    cut = free.text.find(stop)
    stopped = started.generate("control", ids, max_tokens=30, seed=9, stop=(stop,)).result
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[:cut]
    assert stopped.token_ids == free.token_ids[: cut + len(stop)]


def test_prompt_longer_than_context_is_rejected(started):
    with pytest.raises(ValueError, match="prompt"):
        started.submit("control", [1] * 200, max_tokens=4)


@pytest.mark.parametrize(
    "versions,spans",
    [
        ((), []),
        ((3,), [VersionSpan(3, 0, 1)]),
        ((0, 0, 1, 1, 1), [VersionSpan(0, 0, 2), VersionSpan(1, 2, 5)]),
        ((4, 5, 6), [VersionSpan(4, 0, 1), VersionSpan(5, 1, 2), VersionSpan(6, 2, 3)]),
    ],
)
def test_version_spans(versions, spans):
    assert version_spans(versions) == spans


def test_assign_arm_is_stable_and_proportional():
    users = [f"u{i}" for i in range(4000)]
    arms = [assign_arm(u, 0.25) for u in users]
    assert arms == [assign_arm(u, 0.25) for u in users]
    assert 0.2 < arms.count("treatment") / len(users) < 0.3
    assert {assign_arm(u, 0.0) for u in users} == {"control"}
    assert {assign_arm(u, 1.0) for u in users} == {"treatment"}


def _fmix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_counter_uniform_is_the_documented_hash():
    # Rollouts must stay reproducible from (seed, weights) across releases: the vectorized
    # hash against the same function on Python ints, one value at a time.
    from rtrl.inference.sampling import counter_uniform

    seeds = [0, 1, 2**32 - 1, 2**32, 2**62 + 12345, 2**63 - 1]
    for counter in (0, 1, 77, 2**32 + 5):
        got = counter_uniform(torch.tensor(seeds), counter).tolist()
        for seed, value in zip(seeds, got, strict=True):
            lo, hi = seed & 0xFFFFFFFF, seed >> 32
            x = _fmix32(lo ^ _fmix32((counter & 0xFFFFFFFF) ^ 0x9E3779B9))
            x = _fmix32(x ^ hi ^ 0x7F4A7C15)
            y = _fmix32(x ^ 0x632BE5AB)
            assert value == ((x << 21) | (y >> 11)) / float(1 << 53)
    per_row = counter_uniform(torch.tensor(seeds[:3]), torch.tensor([4, 5, 6])).tolist()
    assert per_row == [
        counter_uniform(torch.tensor([s]), c).item()
        for s, c in zip(seeds[:3], (4, 5, 6), strict=True)
    ]
