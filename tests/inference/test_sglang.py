"""The SGLang backend against a real SGLang 0.5.23 server on this CPU (one per module,
started by scripts/sglang_rig.py, installed into its cached venv if it is not yet).

Weights are swapped into generations that are running, in both pause modes; the
version spans SGLang reports tile the tokens and land in the RolloutRecord; the
served tokens change to what the new weights dictate; the log-probs are the ones the
embedded engine would record; refused swaps are retried, resumed and reported
without losing the version; versions that would crash SGLang never reach it. A
Hugging Face checkpoint (a tiny Qwen3 with a byte-level BPE tokenizer) is served and
swapped the same way, with the trainer's log-probs."""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import pytest
import torch

from rtrl.inference import records
from rtrl.inference.batch import SequenceParams
from rtrl.inference.sampling import sampling_logprobs
from rtrl.inference.sglang_adapter import DEMO, ServedModel, SGLangGenerationError, generate
from rtrl.inference.sglang_inventory import (
    WeightsRejected,
    as_served,
    check_fits,
    inventory_of,
    served_dtype,
    served_inventory,
)
from rtrl.inference.sglang_sidecar import SGLangSidecar, SidecarSettings, WeightUpdateRefused
from rtrl.inference.sglang_weight_protocol import SGLangRefused, SGLangWeights
from rtrl.ops.tiny_model import write_tiny_checkpoint
from rtrl.policy import BOS, build_model, encode, load_weights, state_dict_fp32
from rtrl.v1 import common_pb2, rollout_pb2
from support import wait
from support.sglang import installed, post, push, rig, slowed

# A fresh SGLang install downloads ~11 GB inside the first test's setup; every wait in
# the tests themselves has its own, much shorter, timeout.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]

torch.set_num_threads(1)

ARM = "treatment"
PROMPT = (BOS, *encode("def add(a, b):"))


@pytest.fixture(scope="module")
def sglang(tmp_path_factory):
    installed()
    workdir = tmp_path_factory.mktemp("sglang")
    model_dir = rig.write_tiny_model(workdir / "model", seed=0)
    server = rig.start_server(model_dir, workdir / "sglang.log")
    print(f"\nSGLang ready in {server.startup_s:.1f} s, RSS {server.rss_bytes() / 2**20:.0f} MiB")
    yield server, model_dir
    server.stop()


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    """A tiny random Hugging Face Qwen3 checkpoint: byte-level BPE, ChatML, untied head."""
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("qwen3") / "model", "qwen3", seed=0, max_positions=256
    )


@pytest.fixture(scope="module")
def qwen3(qwen3_dir):
    installed()
    server = rig.start_server(qwen3_dir, qwen3_dir.parent / "sglang.log")
    print(
        f"\nSGLang (Qwen3) ready in {server.startup_s:.1f} s, RSS {server.rss_bytes() / 2**20:.0f} MiB"
    )
    yield server, qwen3_dir
    server.stop()


def make_sidecar(sglang, weights: SGLangWeights | None = None, **settings) -> SGLangSidecar:
    server, model_dir = sglang
    config = SidecarSettings(url=server.url, model_dir=model_dir, **settings)
    return SGLangSidecar(weights or SGLangWeights(server.url), served_inventory(model_dir), config)


def base_weights(seed: int) -> dict[str, torch.Tensor]:
    """The policy at ``seed`` with its (tied) embeddings scaled up, so its next-token
    distributions are peaked enough that nucleus boundaries do not hinge on rounding."""
    weights = state_dict_fp32(build_model(seed=seed))
    weights["model.embed_tokens.weight"] *= 10
    return weights


def dominant_weights(char: str) -> dict[str, torch.Tensor]:
    """Weights under which the next token is ``char`` whatever came before: every layer
    adds nothing to the residual stream (zero output projections), every embedding
    points along one axis, and ``char``'s is ten times longer, so after the final norm
    its logit beats every other by 9 * sqrt(hidden)."""
    weights = base_weights(0)
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
        elif name.endswith("norm.weight"):
            tensor.fill_(1.0)
    embed = weights["model.embed_tokens.weight"]
    embed.zero_()
    embed[:, 0] = 1.0
    embed[encode(char)[0], 0] = 10.0
    return weights


def greedy(max_tokens: int) -> SequenceParams:
    return SequenceParams(
        prompt_ids=PROMPT,
        max_tokens=max_tokens,
        temperature=0.0,
        top_p=1.0,
        seed=7,
        ignore_eos=True,
    )


def context() -> records.RolloutContext:
    return records.RolloutContext(
        rollout_id="r-1",
        session_id="s-1",
        user_id="u-1",
        client_ts_ms=1,
        worker_id="sglang-test",
        model_name="rtrl-policy",
        prompt_text="def add(a, b):",
    )


class Generation:
    """A generation running in a thread; ``progressed`` is set once it has ``after`` tokens."""

    def __init__(
        self, url: str, params: SequenceParams, after: int = 10, model: ServedModel = DEMO
    ) -> None:
        self.progressed = threading.Event()
        self.completion = None
        self.error: BaseException | None = None

        def on_tokens(n: int) -> None:
            if n >= after:
                self.progressed.set()

        def run() -> None:
            try:
                self.completion = generate(
                    url, ARM, params, timeout_s=60, on_tokens=on_tokens, model=model
                )
            except BaseException as exc:
                self.error = exc

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def result(self):
        self._thread.join(60)
        assert not self._thread.is_alive(), (
            "the generation never finished: was the server left paused?"
        )
        if self.error is not None:
            raise self.error
        return self.completion


@pytest.fixture
def slow_decode(sglang):
    with slowed(sglang[0]):
        yield


@pytest.mark.guarantee(3)
@pytest.mark.parametrize("pause_mode", ["in_place", "retract"])
def test_swap_mid_generation_splits_versions_and_changes_the_tokens(
    sglang, slow_decode, pause_mode
):
    server, _ = sglang
    sidecar = make_sidecar(sglang, pause_mode=pause_mode)
    n = 100
    base = push(sidecar, base_weights(1))
    reference = generate(server.url, ARM, greedy(n), timeout_s=60).result.token_ids
    char = next(c for c in "ZQX#@" if encode(c)[0] not in reference)

    assert sidecar.stage(base + 1, dominant_weights(char))
    running = Generation(server.url, greedy(n))
    assert running.progressed.wait(30)
    swaps = sidecar.swaps
    assert sidecar.apply_pending() == base + 1
    completion = running.result()
    assert sidecar.swaps == swaps + 1 and sidecar.swap_pause_s > 0

    tokens, versions = completion.result.token_ids, completion.result.versions
    assert versions[-1] == base + 1, "the swap landed after the generation had finished"
    k = versions.index(base + 1)
    assert 10 <= k < n and len(tokens) == n
    assert versions == (base,) * k + (base + 1,) * (n - k)
    # Before the swap the tokens are the old weights' own; from the swap on, the new ones'.
    assert tokens[:k] == reference[:k]
    assert set(tokens[k:]) == {encode(char)[0]}

    record = records.rollout_record(context(), completion)
    assert list(record.version_spans) == [
        rollout_pb2.VersionSpan(policy_version=base, start=0, end=k),
        rollout_pb2.VersionSpan(policy_version=base + 1, start=k, end=n),
    ]
    assert list(record.completion_token_ids) == list(tokens)
    assert len(record.completion_logprobs) == n
    assert record.completion_text.endswith(char * (n - k))


@pytest.mark.parametrize(
    ("temperature", "top_p"),
    [
        (1.0, 1.0),  # plain sampling: SGLang's output_token_logprobs
        (0.7, 0.8),  # nucleus: renormalized over the nucleus, from the sampling mask
        (0.0, 1.0),  # greedy: the one-hot limit, log-prob 0
    ],
)
def test_logprobs_are_the_sampling_distributions(sglang, temperature, top_p):
    server, _ = sglang
    sidecar = make_sidecar(sglang)
    weights = base_weights(2)
    version = push(sidecar, weights)
    params = SequenceParams(
        prompt_ids=PROMPT,
        max_tokens=24,
        temperature=temperature,
        top_p=top_p,
        seed=3,
        ignore_eos=True,
    )
    completion = generate(server.url, ARM, params, timeout_s=60)
    tokens = list(completion.result.token_ids)
    assert completion.result.versions == (version,) * len(tokens)

    # Teacher-force the same weights in the trainer's model and apply the embedded
    # engine's definition of the behaviour log-prob.
    model = build_model(seed=2)
    model.load_state_dict(weights, strict=False)
    with torch.no_grad():
        logits = model(torch.tensor([[*PROMPT, *tokens[:-1]]])).logits[0, len(PROMPT) - 1 :]
    n = len(tokens)
    expected = (
        sampling_logprobs(logits, torch.full((n,), temperature), torch.full((n,), top_p))
        .gather(-1, torch.tensor(tokens).unsqueeze(-1))
        .squeeze(-1)
    )
    assert torch.allclose(torch.tensor(completion.result.logprobs), expected, atol=2e-3), (
        completion.result.logprobs,
        expected.tolist(),
    )
    record = records.rollout_record(context(), completion)
    assert record.sampling.temperature == pytest.approx(
        temperature
    ) and record.sampling.top_p == pytest.approx(top_p)
    assert record.time_to_first_token_s <= record.latency_s


class ForeignSessionEndsAfterFirstRefusal(SGLangWeights):
    """Another writer holds a weight-update session and finishes once ours was refused."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.refusals = 0

    def begin(self) -> None:
        try:
            super().begin()
        except SGLangRefused:
            self.refusals += 1
            if self.refusals == 1:
                SGLangWeights(self.url).end()
            raise


def test_refused_swap_is_retried_and_generation_resumes(sglang, slow_decode):
    server, _ = sglang
    weights = ForeignSessionEndsAfterFirstRefusal(server.url)
    sidecar = make_sidecar(sglang, weights, backoff_s=0.1)
    base = push(sidecar, base_weights(1))

    SGLangWeights(server.url).begin()
    assert sidecar.stage(base + 1, dominant_weights("Z"))
    running = Generation(server.url, greedy(80))
    assert running.progressed.wait(30)
    assert sidecar.apply_pending() == base + 1
    completion = running.result()

    assert weights.refusals == 1
    k = completion.result.versions.index(base + 1)
    assert set(completion.result.token_ids[k:]) == {encode("Z")[0]}


def test_refusal_is_reported_and_the_version_applies_next_time(sglang, slow_decode):
    server, _ = sglang
    sidecar = make_sidecar(sglang, max_attempts=2, backoff_s=0.1)
    base = push(sidecar, base_weights(1))

    foreign = SGLangWeights(server.url)
    foreign.begin()
    try:
        assert sidecar.stage(base + 1, dominant_weights("Q"))
        running = Generation(server.url, greedy(60))
        assert running.progressed.wait(30)
        with pytest.raises(WeightUpdateRefused) as refused:
            sidecar.apply_pending()
        # Resumed after every refused attempt: the generation finishes, all on the old version.
        completion = running.result()
    finally:
        foreign.end()
    assert (
        refused.value.attempts == 2
        and refused.value.last.step == "begin"
        and refused.value.last.status == 400
    )
    assert "already open" in refused.value.last.message
    assert completion.result.versions == (base,) * 60
    assert SGLangWeights(server.url).weight_version() == str(base)
    assert sidecar.pending_version == base + 1

    assert sidecar.apply_pending() == base + 1
    after = generate(server.url, ARM, greedy(8), timeout_s=60)
    assert after.result.versions == (base + 1,) * 8 and set(after.result.token_ids) == {
        encode("Q")[0]
    }


def _wrong_shape(weights):
    weights["model.norm.weight"] = torch.ones(7)


def _unknown_name(weights):
    weights["model.layers.9.mlp.gate_proj.weight"] = torch.zeros(384, 128)


def _missing(weights):
    del weights["model.layers.0.mlp.up_proj.weight"]


@pytest.mark.parametrize(
    "spoil",
    [
        _wrong_shape,  # SGLang 0.5.23's loader asserts on it and the whole server exits
        _unknown_name,  # SGLang skips it yet reports the new version
        _missing,  # the old tensor would keep serving under the new version's label
    ],
)
def test_version_that_does_not_fit_never_reaches_the_server(sglang, spoil):
    server, _ = sglang
    sidecar = make_sidecar(sglang)
    before = SGLangWeights(server.url).weight_version()
    bad = base_weights(1)
    spoil(bad)
    with pytest.raises(WeightsRejected):
        sidecar.stage(sidecar.applied_version + 1, bad)
    assert sidecar.pending_version is None
    assert SGLangWeights(server.url).weight_version() == before

    version = push(sidecar, dominant_weights("X"))
    after = generate(server.url, ARM, greedy(8), timeout_s=60)
    assert after.result.versions == (version,) * 8 and set(after.result.token_ids) == {
        encode("X")[0]
    }


def test_sidecar_follows_weight_sync_into_sglang(sglang, server, publisher):
    """The service path: versions published to weight_sync (a keyframe, then a delta)
    are rebuilt by the Subscriber and swapped into SGLang by the sidecar's threads."""
    from support.weight_sync import ARM as SYNC_ARM
    from support.weight_sync import MANIFEST_PUBLIC_KEYS, SUBSCRIBE_TOKEN

    sglang_server, _ = sglang
    # weight_sync numbers this fresh arm from 0; label the server's weights as older,
    # as a freshly started server's are.
    post(sglang_server, "/update_weight_version", {"new_version": "-1"})
    sidecar = make_sidecar(sglang, arm=SYNC_ARM, retry_s=0.5)
    sidecar.start(server.addr, SUBSCRIBE_TOKEN, "sglang-sidecar-test", MANIFEST_PUBLIC_KEYS)
    try:
        assert publisher.publish(base_weights(4)) == 0
        assert publisher.publish(dominant_weights("#")) == 1
        wait.until(
            lambda: sidecar.applied_version,
            "the sidecar to apply v1",
            ready=lambda applied: applied >= 1,
            interval_s=0.1,
        )
        assert sidecar.applied_version == 1
    finally:
        sidecar.stop()
    after = generate(sglang_server.url, ARM, greedy(8), timeout_s=60)
    assert after.result.versions == (1,) * 8 and set(after.result.token_ids) == {encode("#")[0]}


def test_the_serving_api_fronts_sglang(sglang, stack_settings):
    """``RTRL_INFERENCE_BACKEND=sglang``: the same /v1/completions and the same rollout
    records, generated by SGLang; the version it serves (set by its sidecar) is reported
    as applied, and what it cannot do is refused with a clear 400."""
    import asyncio

    import aiohttp
    import redis

    from rtrl.inference.config import InferenceSettings
    from rtrl.inference.server import start
    from support.inference import read_rollouts

    sglang_server, _ = sglang
    sidecar = make_sidecar(sglang)
    version = push(sidecar, base_weights(5))
    settings = InferenceSettings(
        http_port=0,
        backend="sglang",
        sglang_urls=f"treatment={sglang_server.url}",
        treatment_fraction=1.0,
        max_tokens=12,
        auth_required=False,
    )

    async def scenario():
        server = await start(stack_settings, settings)
        try:
            async with aiohttp.ClientSession() as http:
                await wait.until_async(
                    server.engine.versions,
                    f"the server to report v{version} served",
                    ready=lambda versions: versions == {ARM: version},
                    timeout_s=10,
                    interval_s=0.1,
                )
                url = f"http://127.0.0.1:{server.port}/v1/completions"
                answers = []
                for user in ("u1", "u2", "u3"):
                    async with http.post(
                        url,
                        json={"prompt": "@p1 add x\n", "user_id": user, "session_id": f"s-{user}"},
                    ) as resp:
                        answers.append((resp.status, await resp.json()))
                async with http.post(
                    url,
                    json={
                        "prompt": "@p1 add x\n",
                        "user_id": "u",
                        "session_id": "s",
                        "arm": "control",
                    },
                ) as resp:
                    control = (resp.status, await resp.json())
                async with http.post(
                    url,
                    json={
                        "prompt": "@p1 add x\n",
                        "user_id": "u",
                        "session_id": "s",
                        "stop": ["\n"],
                    },
                ) as resp:
                    stop = (resp.status, await resp.json())
                return answers, control, stop
        finally:
            await server.stop()

    answers, control, stop = asyncio.run(scenario())
    assert [status for status, _ in answers] == [200] * 3, answers
    assert (
        control[0] == 400
        and "no SGLang server serves arm 'control'" in control[1]["error"]["message"]
    )
    assert stop[0] == 400 and "stop strings" in stop[1]["error"]["message"]
    records = {r.rollout_id: r for r in read_rollouts(stack_settings)}
    for _, answer in answers:
        record = records[answer["rollout_id"]]
        n = len(record.completion_token_ids)
        assert 0 < n <= 12 and record.completion_text == answer["text"]
        assert [(s.policy_version, s.start, s.end) for s in record.version_spans] == [
            (version, 0, n)
        ]
        assert len(record.completion_logprobs) == n and all(
            lp <= 0 for lp in record.completion_logprobs
        )
        assert record.worker_id == "inference-0" and record.arm == common_pb2.ARM_TREATMENT
    client = redis.Redis.from_url(stack_settings.redis_url)
    try:
        assert set(client.hgetall(f"rtrl:applied:{ARM}:{version}")) == {b"inference-0"}
    finally:
        client.close()


def test_api_keys_keep_generation_to_the_serving_key_and_swaps_to_the_sidecars(tmp_path):
    """Compose launches SGLang with --api-key (the serving API's) and --admin-api-key (the
    sidecars'): without a key nothing generates, and the serving key cannot swap weights."""
    model_dir = rig.write_tiny_model(tmp_path / "model", seed=0)
    keyed = rig.start_server(
        model_dir, tmp_path / "sglang.log", api_key="serve-key", admin_api_key="admin-key"
    )
    try:
        with pytest.raises(SGLangGenerationError, match="HTTP 401"):
            generate(keyed.url, ARM, greedy(4), timeout_s=60)
        assert (
            len(
                generate(
                    keyed.url, ARM, greedy(4), timeout_s=60, api_key="serve-key"
                ).result.token_ids
            )
            == 4
        )
        with pytest.raises(SGLangRefused) as refused:
            SGLangWeights(keyed.url, api_key="serve-key").begin()  # the serving key alone: no swap
        assert refused.value.status == 401
        weights = SGLangWeights(keyed.url, api_key="serve-key", admin_api_key="admin-key")
        config = SidecarSettings(url=keyed.url, model_dir=model_dir)
        sidecar = SGLangSidecar(weights, served_inventory(model_dir), config)
        version = push(sidecar, dominant_weights("K"))
        after = generate(keyed.url, ARM, greedy(6), timeout_s=60, api_key="serve-key")
        assert after.result.versions == (version,) * 6 and set(after.result.token_ids) == {
            encode("K")[0]
        }
    finally:
        keyed.stop()


def test_custom_ops_standin_refuses_every_op(tmp_path):
    root = rig.write_custom_ops_standin(tmp_path)
    spec = importlib.util.spec_from_file_location(
        "standin_custom_ops", root / "vllm" / "_custom_ops.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(NotImplementedError, match="rotary_embedding"):
        module.rotary_embedding(None)


# ---- a Hugging Face checkpoint: a tiny Qwen3 with a byte-level BPE tokenizer ----


def checkpoint_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def perturbed(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Every tensor plus noise: a version that differs from ``weights`` everywhere, so a
    tensor SGLang did not take would show in the log-probs."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: t + 0.05 * torch.randn(t.shape, generator=generator) for name, t in weights.items()
    }


def trainer_logprobs(
    model_dir: Path,
    prompt: tuple[int, ...],
    tokens: list[int],
    versions: list[dict[str, torch.Tensor]],
    k: int,
    *,
    kept_cache: bool,
) -> torch.Tensor:
    """The trainer's log-prob of each completion token: a transformers float32 forward
    over prompt + completion with the weights of the version that sampled it
    (``versions[0]`` before token ``k``, ``versions[1]`` from it on). ``kept_cache``: the
    swap kept the KV cache (pause mode in_place), so the new weights attend to keys and
    values the old ones computed: the prompt's and those of every token but the last the
    old weights sampled (the first decode step under the new weights feeds that one in).
    Otherwise (retract) the new weights re-prefilled the whole sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[*prompt, *tokens]])
    p = len(prompt)
    with torch.no_grad():
        load_weights(model, versions[0])
        if kept_cache:
            before = model(ids[:, : p + k - 1], use_cache=True)
            load_weights(model, versions[1])
            after = model(ids[:, p + k - 1 : -1], past_key_values=before.past_key_values)
            logits = torch.cat([before.logits[0, p - 1 :], after.logits[0]])
        else:
            old = model(ids[:, :-1]).logits[0, p - 1 : p - 1 + k]
            load_weights(model, versions[1])
            logits = torch.cat([old, model(ids[:, :-1]).logits[0, p - 1 + k :]])
    n = len(tokens)
    return (
        sampling_logprobs(logits, torch.ones(n), torch.ones(n))
        .gather(-1, torch.tensor(tokens).unsqueeze(-1))
        .squeeze(-1)
    )


@pytest.mark.parametrize("pause_mode", ["in_place", "retract"])
def test_hugging_face_checkpoint_swaps_mid_generation_with_the_trainers_logprobs(qwen3, pause_mode):
    from transformers import AutoTokenizer

    server, model_dir = qwen3
    model = ServedModel.from_dir(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tuple(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "def add(a, b):"}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )
    weights = SGLangWeights(server.url)
    settings = SidecarSettings(url=server.url, model_dir=model_dir, pause_mode=pause_mode)
    sidecar = SGLangSidecar(weights, inventory_of(weights, model_dir), settings)
    # The checkpoint's own names, q/k norms included, in the dtype the rig serves.
    assert sidecar.inventory["model.layers.1.self_attn.q_norm.weight"].shape == (16,)
    assert {t.dtype for t in sidecar.inventory.values()} == {"float32"}

    old = perturbed(checkpoint_weights(model_dir), seed=1)
    new = perturbed(old, seed=2)
    base = push(sidecar, old)
    assert sidecar.stage(base + 1, new)
    n = 100
    params = SequenceParams(
        prompt_ids=prompt, max_tokens=n, temperature=1.0, top_p=1.0, seed=11, ignore_eos=True
    )
    with slowed(server):
        running = Generation(server.url, params, model=model)
        assert running.progressed.wait(30)
        assert sidecar.apply_pending() == base + 1
        completion = running.result()

    tokens, versions = list(completion.result.token_ids), completion.result.versions
    assert len(tokens) == n
    assert versions[-1] == base + 1, "the swap landed after the generation had finished"
    k = versions.index(base + 1)
    assert 10 <= k < n and versions == (base,) * k + (base + 1,) * (n - k)
    assert completion.result.text == tokenizer.decode(tokens, skip_special_tokens=True)

    kept_cache = pause_mode == "in_place"
    expected = trainer_logprobs(model_dir, prompt, tokens, [old, new], k, kept_cache=kept_cache)
    served = torch.tensor(completion.result.logprobs)
    delta = (served - expected).abs()
    print(f"\n{pause_mode}: swapped after {k}/{n} tokens, max |Δ logp| {delta.max().item():.2e}")
    assert delta.max() <= 1e-4, delta.tolist()
    # The comparison can tell the versions apart: the old weights alone score the tokens
    # after the swap differently.
    stale = trainer_logprobs(model_dir, prompt, tokens, [old, old], k, kept_cache=kept_cache)
    assert (served - stale).abs()[k:].max() > 1e-2


def _fused_qkv(weights):
    layer = "model.layers.0.self_attn."
    weights[layer + "qkv_proj.weight"] = torch.cat(
        [weights.pop(f"{layer}{p}_proj.weight") for p in "qkv"]
    )


def _no_q_norm(weights):
    del weights["model.layers.1.self_attn.q_norm.weight"]


def _integer(weights):
    weights["model.norm.weight"] = weights["model.norm.weight"].long()


def _no_head(weights):
    del weights["lm_head.weight"]


@pytest.mark.parametrize(
    "spoil",
    [
        _fused_qkv,  # SGLang's own fused name: its loader takes the checkpoint's names
        _no_q_norm,  # Qwen3's per-head q norm is served like any other weight
        _integer,  # an integer tensor would be silently converted into the float parameter
        _no_head,  # this checkpoint's head is not tied to its embedding
    ],
)
def test_qwen3_version_that_does_not_fit_is_rejected(qwen3_dir, spoil):
    inventory = served_inventory(qwen3_dir)
    weights = checkpoint_weights(qwen3_dir)
    check_fits(0, weights, inventory)
    spoil(weights)
    with pytest.raises(WeightsRejected):
        check_fits(1, weights, inventory)


def test_versions_are_sent_in_the_dtype_the_server_holds(qwen3_dir):
    inventory = served_inventory(qwen3_dir, "bfloat16")
    weights = {name: t.to(torch.float16) for name, t in checkpoint_weights(qwen3_dir).items()}
    check_fits(0, weights, inventory)
    assert {t.dtype for t in as_served(weights, inventory).values()} == {torch.bfloat16}


@pytest.mark.parametrize(
    ("server_dtype", "config", "served"),
    [
        ("float32", {"dtype": "bfloat16"}, "float32"),  # the rig's --dtype wins
        ("half", {}, "float16"),
        ("auto", {"dtype": "bfloat16"}, "bfloat16"),  # auto keeps the checkpoint's dtype...
        ("auto", {"torch_dtype": "float32"}, "float16"),  # ...but serves float32 ones in half
        ("auto", {"dtype": "float32", "model_type": "gemma2"}, "bfloat16"),  # Gemma in bf16
    ],
)
def test_served_dtype_follows_sglang(qwen3_dir, server_dtype, config, served):
    assert served_dtype(server_dtype, config) == served


def test_tied_head_is_served_through_the_embedding(sglang):
    _, model_dir = sglang
    assert "lm_head.weight" not in served_inventory(model_dir)


def test_sidecar_refuses_a_server_of_another_checkpoint(sglang, qwen3_dir):
    server, _ = sglang
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        inventory_of(SGLangWeights(server.url), qwen3_dir)


def test_served_model_reads_the_checkpoint(qwen3_dir):
    from rtrl.inference.sglang_adapter import request_body

    model = ServedModel.from_dir(qwen3_dir)
    assert (model.vocab_size, model.eos_token_ids, model.max_positions) == (384, (2,), 256)
    ids = model.encode("def add(a, b):")
    assert model.decode([*ids, 2]) == "def add(a, b):"
    params = SequenceParams(prompt_ids=tuple(ids), max_tokens=4, temperature=0.7, top_p=0.8, seed=1)
    sampling = request_body(params, model)["sampling_params"]
    assert sampling["stop_token_ids"] == [2] and sampling["top_k"] == 384
