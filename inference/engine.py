"""The serving engine: one policy per arm, one thread that owns all torch work.

Requests queue per arm. The engine thread runs each arm's requests as a continuous
batch (batch.py): a request joins at the next step boundary, with a prefill of its
prompt, and leaves as soon as it finishes. Up to ``max_batch`` requests per arm run
at once. The forward pass is model.py's lean Llama over a slot KV cache for the Llama
family, or the checkpoint's own transformers forward for any other architecture.

Weights. A new version is staged from any thread: it is checked and turned into
its own immutable Params (or HFParams) there. The engine thread swaps it in between
two decode steps by replacing one reference, so no token is ever sampled from a
half-copied version. Every token records the version that sampled it. Rows running
at the swap keep or recompute their cache (EngineConfig.swap_policy).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import torch

from rtrl.inference.batch import (
    RunningBatch,
    SequenceParams,
    SequenceResult,
    sequence_params,
)
from rtrl.inference.engine_config import EngineConfig, EngineStats
from rtrl.inference.layout import TensorLayout
from rtrl.inference.model import Weights, servable
from rtrl.inference.session_kv import SessionKV
from rtrl.policy import BOS, ModelSpec, encode, weights_digest

log = logging.getLogger(__name__)

ARMS = ("control", "treatment")


def prompt_token_ids(prompt: str) -> list[int]:
    """The policy's prompt format: BOS, then the prompt's characters. Completions end
    with EOS. The trainer's warm start must use the same format."""
    return [BOS, *encode(prompt)]


class ArmNotReady(TimeoutError):
    """The arm had no weights within the request's ready timeout."""


class EngineStopped(RuntimeError):
    """The engine stopped before it served the request: the worker is shutting down, and
    another one may serve it."""


class GenerationAborted(RuntimeError):
    """The request was aborted (``Engine.abort``): nobody reads its completion any more."""


class EngineCrashed(RuntimeError):
    """The engine thread died of an error (logged where it happened, with its traceback):
    every request it held fails with this one. A bug, not a busy worker; the worker exits
    so the supervisor restarts it."""


@dataclass(frozen=True)
class Completion:
    """What the engine returns for one request (times are seconds since submit)."""

    prompt_ids: tuple[int, ...]
    params: SequenceParams
    arm: str
    result: SequenceResult
    queue_s: float
    ttft_s: float
    latency_s: float


@dataclass
class _Pending:
    params: SequenceParams
    arm: str
    submitted: float
    future: Future = field(default_factory=Future)
    on_token: Callable[[int, float, int], None] | None = None
    streamed: int = 0
    """Tokens already handed to on_token."""
    started: float = 0.0
    ttft_s: float = 0.0


class Engine:
    def __init__(
        self,
        config: EngineConfig = EngineConfig(),
        on_applied: Callable[[str, int], None] | None = None,
        on_step: Callable[[str, int], None] | None = None,
    ) -> None:
        """on_applied(arm, version) runs on the engine thread once a version is live;
        on_step(arm, tokens_so_far) runs on the engine thread after every decode step."""
        self.config = config
        self.hf_config = config.model_config()
        self.spec = ModelSpec.from_hf_config(self.hf_config)
        if not self.spec.fast_path:
            log.warning(
                "serving %s through its transformers forward (one row at a time: slower): %s",
                self.spec.model_type,
                self.spec.fast_path_refusal,
            )
        self._layout = TensorLayout(self.hf_config, self.spec.model_type)
        self._params: dict[str, Weights | None] = {arm: None for arm in ARMS}
        self._batches: dict[str, RunningBatch[_Pending]] = {
            arm: RunningBatch(self.spec, config.max_batch, config.decode, self._session_kv())
            for arm in ARMS
        }
        self._versions = {arm: -1 for arm in ARMS}
        self._staged: dict[str, tuple[int, Weights, str]] = {}
        self._digests = {arm: "" for arm in ARMS}
        """rtrl.policy.weights_digest of the weights each arm serves."""
        self._waiting: dict[str, deque[_Pending]] = {arm: deque() for arm in ARMS}
        self._aborting: set[Future] = set()
        """Requests to drop from their batch at the next step boundary (``abort``)."""
        self._cond = threading.Condition(threading.RLock())
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="inference-engine", daemon=True)
        # Public so the process wiring can attach them before start().
        self.on_applied = on_applied
        self.on_step = on_step
        self.stats = EngineStats()
        self.failure: BaseException | None = None

    # ---- any thread -------------------------------------------------------------

    def start(self) -> Engine:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        with self._cond:
            for queue in self._waiting.values():
                while queue:
                    _fail(queue.popleft(), EngineStopped("inference engine stopped"))

    def versions(self) -> dict[str, int]:
        with self._cond:
            return dict(self._versions)

    def digests(self) -> dict[str, str]:
        """Per arm, the digest of the weights it serves (rtrl.policy.weights_digest): a
        worker serving a version bit for bit has the digest of that version's weights."""
        with self._cond:
            return dict(self._digests)

    def held_version(self, arm: str) -> int:
        """The newest version of ``arm`` applied or staged, -1 for none."""
        with self._cond:
            return max(self._versions[arm], self._staged.get(arm, (-1, None, ""))[0])

    def live_weights(self, arm: str) -> dict[str, torch.Tensor]:
        """The weights ``arm`` serves now, under the trainer's names (read-only views)."""
        self._check_arm(arm)
        params = self._params[arm]
        return {} if params is None else params.state_dict()

    def _session_kv(self) -> SessionKV | None:
        keep = self.config.swap_policy == "keep"
        tokens = self.config.session_kv_tokens
        return SessionKV(tokens, reuse_across_versions=keep) if tokens else None

    def sessions_resumed(self) -> tuple[int, int]:
        """(turns that resumed their session's keys and values, positions not prefilled
        again), over both arms."""
        kept = [b.sessions for b in self._batches.values() if b.sessions is not None]
        return sum(k.hits for k in kept), sum(k.reused for k in kept)

    def forget_session(self, session: str) -> None:
        """The session ended: drop the keys and values kept for it (any thread)."""
        for batch in self._batches.values():
            if batch.sessions is not None:
                batch.sessions.forget(session)

    def ready(self) -> bool:
        return self.failure is None and all(v >= 0 for v in self.versions().values())

    def queue_depth(self) -> int:
        with self._cond:
            return sum(len(q) for q in self._waiting.values())

    def running(self) -> int:
        """Requests generating now (holding a row of a batch), over both arms."""
        return sum(len(batch) for batch in self._batches.values())

    def abort(self, future: Future) -> None:
        """Stop the request ``future`` belongs to (any thread): nobody will read it. One
        still queued leaves the queue now; one generating leaves its batch, freeing its
        row, at the next step boundary. Its future then fails with GenerationAborted,
        unless it finished first: wait for it to know the row is free."""
        with self._cond:
            for queue in self._waiting.values():
                for pending in queue:
                    if pending.future is future:
                        queue.remove(pending)
                        self._aborted(pending)
                        return
            if not future.done():
                self._aborting.add(future)
                self._cond.notify_all()

    def stage(self, arm: str, version: int, weights: dict[str, torch.Tensor]) -> bool:
        """Queue a version for ``arm``; the engine applies it at its next step boundary.
        A newer staged version replaces an unapplied older one. Returns False (and
        ignores it) if the arm already holds or has staged this version or a newer one."""
        self._check_arm(arm)
        self._layout.check(weights)  # in the caller's thread, so applying it cannot fail
        if version <= self.held_version(arm):
            log.info("ignoring %s v%d: already at v%d", arm, version, self.held_version(arm))
            return False
        params = servable(weights, self.hf_config, self.spec)
        digest = weights_digest(weights)
        with self._cond:
            newest = self.held_version(arm)
            if version <= newest:
                log.info("ignoring %s v%d: already at v%d", arm, version, newest)
                return False
            self._staged[arm] = (version, params, digest)
            self._cond.notify_all()
        return True

    def submit(
        self,
        arm: str,
        prompt_ids: list[int] | tuple[int, ...],
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
        """Queue a request; the future resolves to a Completion, or fails with ArmNotReady,
        EngineStopped or EngineCrashed. Bad parameters raise ValueError here.

        ``on_token(token_id, logprob, version)`` streams each token as it is sampled,
        on the engine thread (keep it short: it holds up every request). ``session``
        keeps the request's keys and values for the session's next turn."""
        self._check_arm(arm)
        params = sequence_params(
            prompt_ids,
            self.spec.max_positions,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop=stop,
            ignore_eos=ignore_eos,
            session=session,
        )
        pending = _Pending(params, arm, time.monotonic(), on_token=on_token)
        with self._cond:
            if self.failure is not None:
                raise EngineCrashed(f"inference engine crashed: {self.failure!r}")
            if self._stopping:
                raise EngineStopped("inference engine stopped")
            self._waiting[arm].append(pending)
            self._cond.notify_all()
        return pending.future

    def generate(self, arm: str, prompt_ids: list[int], **kwargs) -> Completion:
        """Blocking convenience around submit()."""
        return self.submit(arm, prompt_ids, **kwargs).result()

    def _check_arm(self, arm: str) -> None:
        if arm not in self._params:
            raise ValueError(f"unknown arm {arm!r}; expected one of {ARMS}")

    # ---- engine thread ----------------------------------------------------------

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while True:
                    self._apply_staged()
                    admissions = self._take_work()
                    if admissions is None:
                        return
                    for arm, pendings in admissions.items():
                        self._admit(arm, pendings)
                    self._drop_aborted()
                    for arm, batch in self._batches.items():
                        if batch:
                            self._step(arm, batch)
        except BaseException as exc:
            # A dead engine must not leave callers waiting forever; the server sees
            # `failure` and exits so the supervisor restarts the worker.
            self.failure = exc
            log.exception("inference engine crashed")
            why = f"inference engine crashed: {exc!r}"
            with self._cond:
                self._stopping = True
                for queue in self._waiting.values():
                    while queue:
                        _fail(queue.popleft(), EngineCrashed(why))
                for batch in self._batches.values():
                    for row in batch.rows:
                        _fail(row.owner, EngineCrashed(why))
            raise

    def _apply_staged(self) -> None:
        with self._cond:
            staged, self._staged = self._staged, {}
        for arm, (version, params, digest) in staged.items():
            paused = time.perf_counter()
            self._params[arm] = params
            if self.config.swap_policy == "recompute":
                self._batches[arm].recompute(params, version)
            with self._cond:
                self._versions[arm] = version
                self._digests[arm] = digest
            self.stats.swaps += 1
            self.stats.swap_pause_s += time.perf_counter() - paused
            log.debug("%s now serving v%d", arm, version)
            if self.on_applied is not None:
                self.on_applied(arm, version)

    def _take_work(self) -> dict[str, list[_Pending]] | None:
        """Requests to admit now, per arm (possibly none while batches run or versions
        wait to be applied); blocks while there is nothing to do; None on stop."""
        with self._cond:
            while not self._stopping:
                now = time.monotonic()
                self._expire_unready(now)
                running = any(self._batches.values())
                admissions: dict[str, list[_Pending]] = {}
                next_wait: float | None = None
                for arm, queue in self._waiting.items():
                    free = self._batches[arm].free()
                    if not queue or self._versions[arm] < 0 or not free:
                        continue
                    # An idle arm lets its first request wait a moment for company: one
                    # prefill for several requests. A busy one admits at every step.
                    wait = queue[0].submitted + self.config.batch_wait_s - now
                    if self._batches[arm] or len(queue) >= free or wait <= 0:
                        admissions[arm] = [queue.popleft() for _ in range(min(len(queue), free))]
                    else:
                        next_wait = wait if next_wait is None else min(next_wait, wait)
                if admissions or running or self._staged:
                    return admissions
                if next_wait is None:
                    unready = [
                        q[0].submitted + self.config.ready_timeout_s
                        for arm, q in self._waiting.items()
                        if q and self._versions[arm] < 0
                    ]
                    next_wait = max(min(unready) - now, 0.001) if unready else None
                self._cond.wait(next_wait)
            return None

    def _expire_unready(self, now: float) -> None:
        for arm, queue in self._waiting.items():
            if self._versions[arm] >= 0:
                continue
            while queue and now - queue[0].submitted >= self.config.ready_timeout_s:
                _fail(
                    queue.popleft(),
                    ArmNotReady(
                        f"arm {arm!r} has no weights after {self.config.ready_timeout_s:g} s"
                    ),
                )

    def _drop_aborted(self) -> None:
        """Take the rows ``abort`` asked for out of their batches (a request aborted as it
        finished is already gone)."""
        with self._cond:
            aborting, self._aborting = self._aborting, set()
        if aborting:
            for batch in self._batches.values():
                for pending in batch.drop(lambda owner: owner.future in aborting):
                    self._aborted(pending)

    def _aborted(self, pending: _Pending) -> None:
        self.stats.aborted += 1
        _fail(pending, GenerationAborted("the request was aborted: its client went away"))

    def _admit(self, arm: str, pendings: list[_Pending]) -> None:
        # A request whose future was cancelled (its asyncio waiter was) is not generated;
        # from here on its future can no longer be cancelled, only aborted.
        pendings = [p for p in pendings if p.future.set_running_or_notify_cancel()]
        if not pendings:
            return
        self.stats.batches += 1
        started = time.monotonic()
        for p in pendings:
            p.started = started
        finished = self._batches[arm].admit(
            self._serving(arm), self._versions[arm], [(p.params, p) for p in pendings]
        )
        now = time.monotonic()
        for p in pendings:
            p.ttft_s = now - p.submitted
        self._stream(self._batches[arm], finished)
        self._finish_all(finished, now)

    def _step(self, arm: str, batch: RunningBatch[_Pending]) -> None:
        self.stats.steps += 1
        generated = batch.generated() + 1 if self.on_step is not None else 0
        finished = batch.step(self._serving(arm), self._versions[arm])
        self._stream(batch, finished)
        self._finish_all(finished, time.monotonic())
        if self.on_step is not None:
            self.on_step(arm, generated)

    def _stream(
        self, batch: RunningBatch[_Pending], finished: list[tuple[_Pending, SequenceResult]]
    ) -> None:
        """Hand each request with on_token the tokens it got since the last call."""
        for row in batch.rows:
            if row.owner.on_token is not None:
                _send(row.owner, row.tokens, row.logprobs, row.versions)
        for pending, result in finished:
            if pending.on_token is not None:
                _send(pending, result.token_ids, result.logprobs, result.versions)

    def _serving(self, arm: str) -> Weights:
        """The weights ``arm`` serves; it admits requests only once it has a version."""
        params = self._params[arm]
        assert params is not None
        return params

    def _finish_all(self, finished: list[tuple[_Pending, SequenceResult]], now: float) -> None:
        for pending, result in finished:
            self._finish(pending, result, now)

    def _finish(self, pending: _Pending, result: SequenceResult, now: float) -> None:
        self.stats.completions += 1
        self.stats.tokens += len(result.token_ids)
        pending.future.set_result(
            Completion(
                prompt_ids=pending.params.prompt_ids,
                params=pending.params,
                arm=pending.arm,
                result=result,
                queue_s=pending.started - pending.submitted,
                ttft_s=pending.ttft_s,
                latency_s=now - pending.submitted,
            )
        )


def _send(
    pending: _Pending, tokens: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]
) -> None:
    on_token = pending.on_token
    assert on_token is not None  # only requests that stream are sent their tokens
    for i in range(pending.streamed, len(tokens)):
        on_token(tokens[i], logprobs[i], versions[i])
    pending.streamed = len(tokens)


def _fail(pending: _Pending, exc: BaseException) -> None:
    try:
        pending.future.set_exception(exc)
    except InvalidStateError:  # done already, or cancelled while it waited
        pass
