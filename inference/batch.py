"""Continuous batching: the sequences of one arm, decoded together, joining and
leaving the batch at any step boundary.

A request is admitted with a prefill of its prompt into a free row of the arm's
cache (model.py's SlotCache, or TransformersCache for models served through
transformers),
which samples its first token. From then on, every step feeds each row its last
sampled token and samples the next, one forward over all rows.
A row leaves as soon as it finishes, and the last row moves into its place. The
batch never waits for its slowest member, and a new request never waits for a
batch to drain.

Versions. Each step samples under one weight version (Params), and every token
records the version that sampled it. When the engine swaps versions between steps,
the rows already running either keep the keys and values computed under the old
weights ("keep": the next forward of each row runs under the new weights over the
old cache) or recompute them ("recompute": every row's tokens so far are prefilled
again under the new weights first, so the rest of the sequence is generated as if
the new weights had produced its context). Both caches do both.

Routes. A MoE model served through transformers records the experts chosen at every
position a row ran (model.Routes), and its result carries them: the prompt's, then
each sampled token's but the last, which is never fed back. Those are the rows the
trainer replays. Under "recompute" a position's routes are those of its latest
forward, the re-prefill's.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

import torch

from rtrl.inference.model import Routes, SlotCache, Weights, new_cache
from rtrl.inference.sampling import sample
from rtrl.inference.session_kv import MIXED, Parked, SessionKV
from rtrl.policy import ModelSpec

SwapPolicy = Literal["keep", "recompute"]
FinishReason = Literal["stop", "length"]
Owner = TypeVar("Owner")
"""The engine's handle for a request, carried through the batch and returned with its result."""


@dataclass(frozen=True)
class SequenceParams:
    """What the engine asks a batch to generate for one request."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    """Generate exactly max_tokens (benchmarks that must match another generator's lengths)."""
    session: str = ""
    """An agent's trajectory link: its keys and values are kept for its next turn
    (inference/session_kv.py); "" keeps nothing."""


def sequence_params(
    prompt_ids: Sequence[int],
    max_positions: int,
    *,
    max_tokens: int,
    temperature: float,
    top_p: float,
    seed: int | None,
    stop: tuple[str, ...],
    ignore_eos: bool,
    session: str = "",
) -> SequenceParams:
    """A request's checked parameters (ValueError names what is wrong), with
    ``max_tokens`` cut to the context left after the prompt and a random seed if none
    was given. Shared by both backends (inference.sglang_adapter.SGLangEngine)."""
    if not 0 < len(prompt_ids) < max_positions:
        raise ValueError(f"prompt is {len(prompt_ids)} tokens; it must be 1..{max_positions - 1}")
    if max_tokens < 1 or temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(
            f"bad sampling params: max_tokens={max_tokens} temperature={temperature} top_p={top_p}"
        )
    params = SequenceParams(
        prompt_ids=tuple(prompt_ids),
        max_tokens=min(max_tokens, max_positions - len(prompt_ids)),
        temperature=float(temperature),
        top_p=float(top_p),
        seed=secrets.randbits(63) if seed is None else seed,
        stop=tuple(stop),
        ignore_eos=ignore_eos,
        session=session,
    )
    if not 0 <= params.seed < 2**63:
        raise ValueError(f"seed must be in [0, 2**63), got {params.seed}")
    return params


@dataclass(frozen=True)
class SequenceResult:
    """One finished row. versions[i] is the weight version that sampled token_ids[i]."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finish_reason: FinishReason
    text: str
    router_choices: Routes | None = None
    """A MoE model's experts at each position the sampler ran (prompt + completion − 1
    of them), None for a dense model or a backend that does not record them."""


@dataclass
class Row(Generic[Owner]):
    params: SequenceParams
    owner: Owner
    """The engine's handle for the request (returned with its result)."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    position: int = 0
    """Tokens in the cache: the prompt and every generated token but the last."""
    kv_version: int = MIXED
    """The version that computed the row's keys and values (MIXED across a swap)."""


class RunningBatch(Generic[Owner]):
    """Not thread-safe: owned by the engine thread. Call under torch.inference_mode()."""

    def __init__(
        self,
        spec: ModelSpec,
        slots: int,
        decode: Callable[[Sequence[int]], str],
        sessions: SessionKV | None = None,
    ) -> None:
        """``decode`` turns generated ids into text, for stop strings and results;
        ``sessions`` keeps agents' keys and values between turns (fast path only)."""
        self.cache = new_cache(spec, slots)
        self.sessions = sessions if isinstance(self.cache, SlotCache) else None
        self.slots = slots
        self.eos = frozenset(spec.eos_token_ids)
        self.decode = decode
        self.rows: list[Row[Owner]] = []
        self._sampling: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        """Every row's (temperature, top_p, seed), rebuilt only when rows join or leave."""

    def __len__(self) -> int:
        return len(self.rows)

    def free(self) -> int:
        return self.slots - len(self.rows)

    def generated(self) -> int:
        """The most tokens any running row has generated."""
        return max((len(r.tokens) for r in self.rows), default=0)

    def admit(
        self, params: Weights, version: int, requests: list[tuple[SequenceParams, Owner]]
    ) -> list[tuple[Owner, SequenceResult]]:
        """Prefill ``requests`` (sequence, owner) into free rows and sample their first
        tokens under ``version``; returns those already finished (owner, result)."""
        if len(requests) > self.free():
            raise ValueError(f"{len(requests)} requests for {self.free()} free rows")
        first = len(self.rows)
        kept = [self._kept(seq, version) for seq, _ in requests]
        # Rows prefilled whole first (one forward), then those resuming a session.
        order = sorted(range(len(requests)), key=lambda i: kept[i] is not None)
        self.rows.extend(
            Row(seq, owner, position=len(seq.prompt_ids), kv_version=version)
            for seq, owner in (requests[i] for i in order)
        )
        self._sampling = None
        whole = [list(requests[i][0].prompt_ids) for i in order if kept[i] is None]
        logits = [self.cache.prefill(params, first, whole)] if whole else []
        for row, i in enumerate(order[len(whole) :], first + len(whole)):
            parked = kept[i]
            assert parked is not None and isinstance(self.cache, SlotCache)
            n = len(parked.ids)
            self.cache.k[:, row, :, :, :n] = parked.k
            self.cache.v[:, row, :, :n] = parked.v
            self.rows[row].kv_version = parked.version if parked.version == version else MIXED
            rest = list(requests[i][0].prompt_ids[n:])
            logits.append(self.cache.prefill(params, row, [rest], start=n))
        return self._sample(torch.cat(logits), range(first, len(self.rows)), version)

    def _kept(self, seq: SequenceParams, version: int) -> Parked | None:
        if not seq.session or self.sessions is None:
            return None
        return self.sessions.take(seq.session, seq.prompt_ids, version)

    def step(self, params: Weights, version: int) -> list[tuple[Owner, SequenceResult]]:
        """One token for every row under ``version``; returns the rows that finished."""
        if not self.rows:
            return []
        logits = self.cache.decode(
            params, [r.tokens[-1] for r in self.rows], [r.position for r in self.rows]
        )
        for r in self.rows:
            r.position += 1
            if r.kv_version != version:
                r.kv_version = MIXED  # "keep": a new version over an older one's context
        return self._sample(logits, range(len(self.rows)), version)

    def recompute(self, params: Weights, version: int) -> None:
        """Rebuild every row's cache under ``params`` (the "recompute" swap policy)."""
        if self.rows:
            self.cache.prefill(
                params, 0, [[*r.params.prompt_ids, *r.tokens[:-1]] for r in self.rows]
            )
        for r in self.rows:
            r.kv_version = version

    def _sample(
        self, logits: torch.Tensor, indices: range, version: int
    ) -> list[tuple[Owner, SequenceResult]]:
        rows = [self.rows[i] for i in indices]
        if len(rows) == len(self.rows) and self._sampling is not None:
            temperature, top_p, seeds = self._sampling
        else:
            temperature = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32)
            top_p = torch.tensor([r.params.top_p for r in rows], dtype=torch.float32)
            seeds = torch.tensor([r.params.seed for r in rows], dtype=torch.int64)
            if len(rows) == len(self.rows):
                self._sampling = (temperature, top_p, seeds)
        tokens, logprobs = sample(
            logits,
            temperature,
            top_p,
            seeds,
            torch.tensor([len(r.tokens) for r in rows], dtype=torch.int64),
        )
        finished: list[tuple[int, SequenceResult]] = []
        for i, row, token, logprob in zip(
            indices, rows, tokens.tolist(), logprobs.tolist(), strict=True
        ):
            row.tokens.append(token)
            row.logprobs.append(logprob)
            row.versions.append(version)
            result = self._finished(i, row)
            if result is not None:
                finished.append((i, result))
        done = [(self.rows[i].owner, result) for i, result in finished]
        for i, _ in finished:
            self._park(i)
        for i, _ in reversed(finished):  # highest row first: a removal moves the last row
            self._remove(i)
        return done

    def _finished(self, i: int, row: Row[Owner]) -> SequenceResult | None:
        """Row ``i``'s result if it is done, else None."""
        p = row.params
        text = None
        if p.stop:
            generated = self.decode(row.tokens)
            hits = [generated.find(s) for s in p.stop if s in generated]
            if hits:
                text = generated[: min(hits)]
        eos = row.tokens[-1] in self.eos and not p.ignore_eos
        if text is None and not eos and len(row.tokens) < p.max_tokens:
            return None
        return SequenceResult(
            token_ids=tuple(row.tokens),
            logprobs=tuple(row.logprobs),
            versions=tuple(row.versions),
            finish_reason="stop" if eos or text is not None else "length",
            text=text if text is not None else self.decode(row.tokens),
            router_choices=self._routes(i, row),
        )

    def _routes(self, i: int, row: Row[Owner]) -> Routes | None:
        """Row ``i``'s routes, one per position in its cache (raises if any is missing)."""
        routes = self.cache.routes(i)
        if routes is not None and routes.expert_ids.shape[0] != row.position:
            raise RuntimeError(
                f"routes of {routes.expert_ids.shape[0]} positions for a row that ran {row.position}"
            )
        return routes

    def _park(self, i: int) -> None:
        """Keep a finished session row's keys and values for its next turn."""
        row = self.rows[i]
        if not row.params.session or self.sessions is None:
            return
        assert isinstance(self.cache, SlotCache)
        n = row.position
        ids = (*row.params.prompt_ids, *row.tokens[:-1])
        k, v = self.cache.k[:, i, :, :, :n].clone(), self.cache.v[:, i, :, :n].clone()
        self.sessions.park(row.params.session, Parked(ids, k, v, row.kv_version))

    def drop(self, dropped: Callable[[Owner], bool]) -> list[Owner]:
        """Take out, unfinished, the rows whose owner ``dropped`` names (their requests were
        aborted), keeping nothing of them; returns their owners."""
        gone = [i for i, row in enumerate(self.rows) if dropped(row.owner)]
        owners = [self.rows[i].owner for i in gone]
        for i in reversed(gone):  # highest row first: a removal moves the last row
            self._remove(i)
        return owners

    def _remove(self, i: int) -> None:
        self._sampling = None
        last = len(self.rows) - 1
        if i != last:
            self.cache.move(last, i, self.rows[last].position)
            self.rows[i] = self.rows[last]
        self.rows.pop()
