"""The SGLang backend's serving side: one completion from SGLang's /generate, returned
as the embedded engine's Completion, so inference.records.rollout_record builds the
same RolloutRecord for both backends.

The request carries token ids (the server runs with ``--skip-tokenizer-init``): the
checkpoint's tokenizer lives on this side (``ServedModel``: the demo policy's character
vocabulary, or any Hugging Face checkpoint directory's tokenizer). It streams, so the
time to the first token is measured as the embedded engine measures it. The final chunk carries every token, its
log-prob, and ``meta_info.weight_versions``: the spans of tokens each weight version
sampled, which the sidecar's mid-generation swaps split (inference/sglang_sidecar.py).

Log-probs are those of the distribution each token was actually sampled from, as in
inference/sampling.py. SGLang's ``output_token_logprobs`` are that distribution for
plain temperature sampling; greedy and nucleus sampling draw from a truncated one, so
for them the renormalized log-probs come from SGLang's sampling mask instead.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rtrl.checkpoint import Checkpoint
from rtrl.inference.batch import SequenceParams, SequenceResult, sequence_params
from rtrl.inference.engine import Completion, EngineStats
from rtrl.inference.sglang_weight_protocol import SGLangWeights

log = logging.getLogger(__name__)


class SGLangGenerationError(RuntimeError):
    """SGLang answered /generate with an error or ended the request without finishing it."""


@dataclass(frozen=True)
class ServedModel:
    """What this side needs of the checkpoint SGLang serves: SGLang skips its tokenizer,
    so decoding (and ending on the tokenizer's EOS) happens here."""

    vocab_size: int
    """Rows of the output layer (config.json's ``vocab_size``): the top_k that truncates nothing."""
    eos_token_ids: tuple[int, ...]
    """Ids that end a completion: the config's and the tokenizer's. SGLang without its
    tokenizer knows only the config's (and generation_config.json's), so they are sent
    with every request that does not ignore EOS."""
    max_positions: int
    """Longest prompt + completion in tokens (config.json's ``max_position_embeddings``)."""
    decode: Callable[[Sequence[int]], str]
    """Token ids to text, special tokens left out."""
    encode: Callable[[str], list[int]]
    """Text to the ids of a prompt, with the tokens the tokenizer adds in front."""

    @classmethod
    def of(cls, checkpoint: Checkpoint) -> ServedModel:
        """What SGLang's side needs of ``checkpoint`` (rtrl.checkpoint: the one loading path)."""
        return cls(
            vocab_size=checkpoint.spec.vocab_size,
            eos_token_ids=checkpoint.eos_token_ids,
            max_positions=checkpoint.max_positions,
            decode=checkpoint.decode,
            encode=checkpoint.encode,
        )

    @classmethod
    def demo(cls) -> ServedModel:
        """The built-in demo policy (rtrl.policy: a character vocabulary)."""
        return cls.of(Checkpoint.builtin_demo())

    @classmethod
    def from_dir(cls, model_dir: Path) -> ServedModel:
        """A Hugging Face checkpoint directory: config.json and its tokenizer files."""
        return cls.of(Checkpoint.open(model_dir))


DEMO = ServedModel.demo()


def served_model(model_dir: Path | None) -> ServedModel:
    """The checkpoint at ``model_dir``, or the demo policy when there is none."""
    return DEMO if model_dir is None else ServedModel.from_dir(model_dir)


def request_body(params: SequenceParams, model: ServedModel = DEMO) -> dict[str, Any]:
    """The /generate body for ``params`` (streaming, with log-probs)."""
    if params.stop:
        raise ValueError(
            f"stop strings {params.stop!r} need SGLang's tokenizer, which this backend skips; stop on EOS or max_tokens"
        )
    truncated = params.temperature == 0 or params.top_p < 1
    sampling: dict[str, Any] = {
        "max_new_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "sampling_seed": params.seed,
        "ignore_eos": params.ignore_eos,
    }
    if not params.ignore_eos and model.eos_token_ids:
        sampling["stop_token_ids"] = list(model.eos_token_ids)
    if params.top_p < 1 and params.temperature > 0:
        # SGLang's sampling mask needs a finite top_k; the whole vocabulary truncates nothing.
        sampling["top_k"] = model.vocab_size
    return {
        "input_ids": list(params.prompt_ids),
        "sampling_params": sampling,
        "return_logprob": True,
        "return_sampling_mask": truncated,
        "stream": True,
    }


def completion_from_response(
    response: dict[str, Any],
    params: SequenceParams,
    arm: str,
    *,
    ttft_s: float,
    latency_s: float,
    model: ServedModel = DEMO,
) -> Completion:
    """The engine's Completion for SGLang's final /generate chunk."""
    meta = response["meta_info"]
    finish = meta.get("finish_reason") or {}
    if finish.get("type") not in ("stop", "length"):
        raise SGLangGenerationError(
            f"SGLang ended request {meta.get('id')} with finish_reason {finish or None}: {finish.get('message', '')}"
        )
    token_ids = tuple(response["output_ids"])
    if "output_token_sampling_logprobs" in meta:
        logprobs = tuple(float(x) for x in meta["output_token_sampling_logprobs"])
    else:
        logprobs = tuple(float(entry[0]) for entry in meta["output_token_logprobs"])
    versions = versions_per_token(meta.get("weight_versions") or [], len(token_ids))
    if len(logprobs) != len(token_ids):
        raise SGLangGenerationError(
            f"SGLang returned {len(token_ids)} tokens but {len(logprobs)} log-probs"
        )
    result = SequenceResult(
        token_ids=token_ids,
        logprobs=logprobs,
        versions=versions,
        finish_reason=finish["type"],
        text=model.decode(token_ids),
    )
    # SGLang queues inside the server; its queue time is part of ttft_s here.
    return Completion(
        prompt_ids=params.prompt_ids,
        params=params,
        arm=arm,
        result=result,
        queue_s=0.0,
        ttft_s=ttft_s,
        latency_s=latency_s,
    )


def versions_per_token(spans: Sequence[dict[str, Any]], n_tokens: int) -> tuple[int, ...]:
    """Expand SGLang's ``weight_versions`` spans ({version, start, end}) to one policy
    version per token, checking that they cover the tokens exactly, in order."""
    versions: list[int] = []
    for span in spans:
        if span["start"] != len(versions) or span["end"] < span["start"]:
            raise SGLangGenerationError(
                f"weight_versions {list(spans)} do not tile tokens [0, {n_tokens})"
            )
        try:
            version = int(span["version"])
        except ValueError:
            raise SGLangGenerationError(
                f"SGLang labels weights {span['version']!r}, not an rtrl policy version: "
                "launch it with --weight-version <n>"
            ) from None
        versions.extend([version] * (span["end"] - span["start"]))
    if len(versions) != n_tokens:
        raise SGLangGenerationError(
            f"weight_versions {list(spans)} cover {len(versions)} of {n_tokens} tokens"
        )
    return tuple(versions)


def generate(
    url: str,
    arm: str,
    params: SequenceParams,
    *,
    timeout_s: float = 300.0,
    on_tokens: Callable[[int], None] | None = None,
    api_key: str = "",
    model: ServedModel = DEMO,
) -> Completion:
    """One completion from the SGLang server at ``url``, which serves ``model``.
    ``on_tokens`` is called with the number of tokens generated so far each time the
    stream reports progress."""
    request = urllib.request.Request(
        f"{url.rstrip('/')}/generate",
        data=json.dumps(request_body(params, model)).encode(),
        headers={
            "Content-Type": "application/json",
            **({"Authorization": f"Bearer {api_key}"} if api_key else {}),
        },
        method="POST",
    )
    started = time.monotonic()
    ttft_s = None
    last: dict[str, Any] | None = None
    try:
        stream = urllib.request.urlopen(request, timeout=timeout_s)
    except urllib.error.HTTPError as exc:
        raise SGLangGenerationError(
            f"SGLang /generate refused the request (HTTP {exc.code}): {exc.read().decode(errors='replace')}"
        ) from None
    with stream:
        for raw in stream:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[len(b"data:") :].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise SGLangGenerationError(f"SGLang /generate failed: {chunk['error']}")
            if ttft_s is None and chunk["output_ids"]:
                ttft_s = time.monotonic() - started
            if on_tokens is not None:
                on_tokens(len(chunk["output_ids"]))
            last = chunk
    if last is None:
        raise SGLangGenerationError("SGLang's /generate stream ended without a result")
    latency_s = time.monotonic() - started
    return completion_from_response(
        last,
        params,
        arm,
        ttft_s=latency_s if ttft_s is None else ttft_s,
        latency_s=latency_s,
        model=model,
    )


class SGLangEngine:
    """The embedded Engine's interface (what inference.server uses) over SGLang servers,
    one per arm: the serving API fronts SGLang the way it fronts the embedded engine,
    and the rollout records are the same. Each request is one streaming /generate on a
    thread of a bounded pool; SGLang batches them itself.

    Weights reach SGLang through its sidecar (inference/sglang_sidecar.py), not through
    this process, so there is nothing to stage here: a poller reads the version each
    server serves (``/model_info``) and reports changes through ``on_applied``, as the
    embedded engine reports a swap."""

    def __init__(
        self,
        urls: Mapping[str, str],
        *,
        model: ServedModel = DEMO,
        max_positions: int | None = None,
        max_concurrency: int = 64,
        timeout_s: float = 300.0,
        poll_s: float = 1.0,
        on_applied: Callable[[str, int], None] | None = None,
        api_key: str = "",
    ) -> None:
        self.urls = dict(urls)
        self.api_key = api_key
        """SGLang's ``--api-key``: generating and reading the version, never swapping weights."""
        self.model = model
        """The checkpoint every arm's server serves (its tokenizer decodes their tokens)."""
        self.max_positions = model.max_positions if max_positions is None else max_positions
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.on_applied = on_applied
        self.stats = EngineStats()
        self.failure: BaseException | None = None
        self._versions = {arm: -1 for arm in self.urls}
        self._lock = threading.Lock()
        self._in_flight = 0
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="sglang")
        self._stopped = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="sglang-versions", daemon=True)

    def start(self) -> None:
        self._poller.start()

    def stop(self) -> None:
        self._stopped.set()
        self._pool.shutdown(wait=True)
        self._poller.join(self.poll_s + 5)

    def ready(self) -> bool:
        return all(v >= 0 for v in self.versions().values())

    def forget_session(self, session: str) -> None:
        """Nothing is kept per session here (SGLang's radix cache evicts on its own)."""

    def abort(self, future: Future) -> None:
        """Drop a request still queued for a connection (the serving API's ``Engine.abort``).
        One SGLang is already generating runs to its end, bounded by ``timeout_s``: its
        waiter holds the request's budget until then. Streams, the way a client drops a
        generation, are the embedded engine's alone."""
        if future.cancel():
            with self._lock:
                self._in_flight -= 1
            self.stats.aborted += 1

    def versions(self) -> dict[str, int]:
        with self._lock:
            return dict(self._versions)

    def digests(self) -> dict[str, str]:
        """SGLang holds the weights, in its own layout: no digest of them here (its
        sidecar verifies every version's checksums as it applies it)."""
        return {}

    def queue_depth(self) -> int:
        with self._lock:
            return self._in_flight

    def submit(
        self,
        arm: str,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: tuple[str, ...] = (),
        ignore_eos: bool = False,
        on_token: Callable[[int, float, int], None] | None = None,
        session: str = "",
    ) -> Future:
        """Queue a request; the future resolves to a Completion or raises
        SGLangGenerationError (the API answers 503). Bad requests raise ValueError here.
        ``session`` is the embedded engine's: SGLang's radix cache finds a turn's prefix
        by itself."""
        if arm not in self.urls:
            raise ValueError(
                f"no SGLang server serves arm {arm!r} (RTRL_INFERENCE_SGLANG_URLS names {', '.join(sorted(self.urls))})"
            )
        if on_token is not None:
            raise ValueError(
                "streaming is not available with the SGLang backend; ask without stream"
            )
        params = sequence_params(
            prompt_ids,
            self.max_positions,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop=stop,
            ignore_eos=ignore_eos,
        )
        request_body(params, self.model)  # refuses what SGLang cannot do before it is queued
        with self._lock:
            self._in_flight += 1
        return self._pool.submit(self._generate, arm, params)

    def _generate(self, arm: str, params: SequenceParams) -> Completion:
        try:
            completion = generate(
                self.urls[arm],
                arm,
                params,
                timeout_s=self.timeout_s,
                api_key=self.api_key,
                model=self.model,
            )
        except OSError as exc:  # connection refused, reset, timed out
            raise SGLangGenerationError(
                f"SGLang at {self.urls[arm]} did not answer: {exc}"
            ) from exc
        finally:
            with self._lock:
                self._in_flight -= 1
        self.stats.completions += 1
        self.stats.tokens += len(completion.result.token_ids)
        return completion

    def _poll(self) -> None:
        servers = {
            arm: SGLangWeights(url, timeout_s=min(self.timeout_s, 10.0), api_key=self.api_key)
            for arm, url in self.urls.items()
        }
        while not self._stopped.is_set():
            for arm, server in servers.items():
                try:
                    version = int(server.weight_version())
                except (OSError, ValueError, KeyError) as exc:
                    log.debug("weight version of %s unknown: %s", arm, exc)
                    continue
                with self._lock:
                    changed = version != self._versions[arm]
                    self._versions[arm] = version
                if changed:
                    self.stats.swaps += 1
                    if self.on_applied is not None:
                        self.on_applied(arm, version)
            self._stopped.wait(self.poll_s)
