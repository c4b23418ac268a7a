"""From RewardRecords to training tensors, on exactly the tokens production sampled.

A record becomes a TrainSample (or a Drop reason) when it is consumed; staleness is
judged again when the batch is cut, since the trainer's version moves meanwhile.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from rtrl.moe import unpack_routes
from rtrl.policy import PAD, VOCAB_SIZE
from rtrl.trajectory import MalformedTrajectory, Segment, Trajectory
from rtrl.trajectory_summary import Summary
from rtrl.trajectory_targets import TargetAlignment, targets
from rtrl.v1 import common_pb2, reward_pb2, rollout_pb2


class Drop(enum.StrEnum):
    """Why a reward record was not trained on (counted, never silent)."""

    CONTROL_ARM = "control_arm"  # control is frozen: its rollouts only serve the A/B comparison
    EMPTY = "empty"  # no completion tokens
    MALFORMED = "malformed"  # log-probs or version spans that do not fit the tokens
    GREEDY = "greedy"  # temperature 0: no exploration, no usable policy gradient
    TOO_LONG = "too_long"  # prompt + completion longer than the model's positions
    DUPLICATE = "duplicate"  # rollout_id already trained on (single epoch)
    STALE = "stale"  # sampled by a version more than max_staleness behind
    SHED = "shed"  # the trainer was behind and fresher rollouts took its place (when_behind=shed)
    UNSIGNED = "unsigned"  # no joiner's signature: not written by the joiner (dead-lettered)
    FORGED = "forged"  # a signature that does not verify, or by an unknown key (dead-lettered)
    BULK_UNAVAILABLE = "bulk_unavailable"  # its bulk is not in the rollout store (rtrl/bulk.py)
    BULK_CORRUPT = "bulk_corrupt"  # the stored bulk is not the one its record names
    DISCARDED = "discarded"  # its reward function keeps it from training (a1h: a broken call)


# Produced by to_sample from a consumed RewardRecord; consumed by collate.
@dataclass(frozen=True)
class TrainSample:
    rollout_id: str
    group: str
    """Comparison group of the leave-one-out baseline."""
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    behaviour_logprobs: tuple[float, ...]
    temperature: float
    reward: float
    oldest_version: int
    """Oldest policy version that produced any of the completion's tokens."""
    last_event_ts_ms: int
    traceparent: str = ""
    """W3C traceparent of the reward's span in the rollout's trace (the serving span's,
    from a joiner that records none); the training step's span links to it."""
    reward_ts_ms: int = 0
    """Wall clock when the joiner wrote the reward record to Kafka (the record's timestamp)."""
    read_ts_ms: int = 0
    """Wall clock when the trainer read the reward record."""
    context: str = ""
    """Context key of the running-mean baseline (trainer/baseline.py); "" for none."""
    router_choices: rollout_pb2.RouterChoices | None = field(default=None, compare=False)
    """A MoE policy's sampled routes, kept packed (a byte per expert id) until collate."""
    token_versions: tuple[int, ...] = ()
    """The version that sampled each completion token (from the record's version spans)."""
    segments: tuple[Segment, ...] = ()
    """An agent's trajectory: its segments, generated and observed, in order (the
    completion is then their generated tokens); () for a single turn."""
    min_version: int = 0
    """Tokens sampled by an older version carry no loss (drop_stale: too stale), while the
    rest of the trajectory trains."""

    @property
    def trajectory(self) -> Trajectory:
        """The prompt and the completion as one generated segment (an agent's: its
        segments). Built without per-token versions (benches, tests), every token takes
        the oldest version."""
        if self.segments:
            return Trajectory(self.prompt_ids, self.segments)
        versions = self.token_versions
        if len(versions) != len(self.completion_ids):
            versions = (self.oldest_version,) * len(self.completion_ids)
        generated = Segment.generated(self.completion_ids, self.behaviour_logprobs, versions)
        return Trajectory.single_turn(self.prompt_ids, generated)


def to_sample(
    record: reward_pb2.RewardRecord,
    max_positions: int,
    context_of: Callable[[rollout_pb2.RolloutRecord], str] | None = None,
    vocab_size: int = VOCAB_SIZE,
) -> TrainSample | Drop:
    """context_of: the product's context key of a rollout (its context_key, else the
    RTRL_TRAINER_CONTEXT_KEY plug-in's: trainer/baseline.py);
    max_positions and vocab_size: the policy's (its checkpoint's)."""
    rollout = record.rollout
    if rollout.arm != common_pb2.ARM_TREATMENT:
        return Drop.CONTROL_ARM
    if record.discarded:
        return Drop.DISCARDED
    if Summary.of(rollout).generated_tokens == 0:
        return Drop.EMPTY
    trajectory = _trainable(rollout, vocab_size)
    if trajectory is None:
        return Drop.MALFORMED
    if rollout.sampling.temperature <= 0:
        return Drop.GREEDY
    prompt, completion = trajectory.prompt_ids, trajectory.generated_ids
    if len(prompt) + sum(len(s.token_ids) for s in trajectory.segments) > max_positions:
        return Drop.TOO_LONG
    return TrainSample(
        rollout_id=sample_id(record),
        group=rollout.prompt_group_id or trajectory.prompt_text or ",".join(map(str, prompt)),
        prompt_ids=prompt,
        completion_ids=completion,
        behaviour_logprobs=trajectory.generated_logprobs,
        temperature=float(rollout.sampling.temperature),
        reward=float(record.reward),
        oldest_version=min(trajectory.generated_versions),
        token_versions=trajectory.generated_versions,
        last_event_ts_ms=int(record.last_event_ts_ms),
        traceparent=record.traceparent or rollout.traceparent,
        context=context_of(rollout) if context_of is not None else "",
        router_choices=rollout.router_choices if rollout.HasField("router_choices") else None,
        segments=() if trajectory.is_flat else trajectory.segments,
    )


def sample_id(record: reward_pb2.RewardRecord) -> str:
    """What the trainer trains once: the rollout, or one link of an agent's chain (its
    links share the rollout's id, and each is trained)."""
    rollout_id = record.rollout_id or record.rollout.rollout_id
    position = record.rollout.link.position if record.rollout.HasField("link") else 0
    return f"{rollout_id}#{position}" if position else rollout_id


def _trainable(rollout: rollout_pb2.RolloutRecord, vocab_size: int) -> Trajectory | None:
    """The rollout's trajectory, or None when it is malformed: log-probs or version spans
    that do not fit its tokens, no prompt, an id outside the vocabulary, or routes that
    miss a position its sampler ran."""
    try:
        trajectory = Trajectory.of(rollout)
        row = targets(trajectory)
    except MalformedTrajectory:
        return None
    if max(row.input_ids) >= vocab_size:
        return None
    return trajectory if _routes_fit(rollout, row.targets) else None


def _routes_fit(rollout: rollout_pb2.RolloutRecord, positions: int) -> bool:
    """A rollout without routes, or whose routes hold one row per position its sampler ran."""
    if not rollout.HasField("router_choices"):
        return True
    try:
        return unpack_routes(rollout.router_choices).shape[0] == positions
    except ValueError:
        return False


def split_even(samples: Sequence[TrainSample], batch_size: int) -> list[list[TrainSample]]:
    """As few batches of at most batch_size as hold every sample, sizes differing by at most one
    (70 pending at batch 64 make two steps of 35, not one of 64 and one of 6)."""
    if not samples:
        return []
    batches = -(-len(samples) // batch_size)
    size, extra = divmod(len(samples), batches)
    out, start = [], 0
    for index in range(batches):
        end = start + size + (index < extra)
        out.append(list(samples[start:end]))
        start = end
    return out


def shed_oldest(samples: Sequence[TrainSample], keep: int) -> tuple[list[TrainSample], int]:
    """The ``keep`` most recently rewarded samples, in their order; returns (kept, how many were shed)."""
    if len(samples) <= keep:
        return list(samples), 0
    newest = sorted(range(len(samples)), key=lambda i: samples[i].reward_ts_ms)[
        len(samples) - keep :
    ]
    return [samples[i] for i in sorted(newest)], len(samples) - keep


def drop_stale(
    samples: Sequence[TrainSample], current_version: int, max_staleness: int
) -> tuple[list[TrainSample], int]:
    """Staleness judged per token: a sample whose every token came from a version more
    than max_staleness behind current is dropped; one whose oldest tokens did is kept
    with those tokens masked (``min_version``: a long trajectory spanning versions still
    trains on its fresh tokens). Returns (kept, how many were dropped)."""
    floor = current_version - max_staleness
    kept: list[TrainSample] = []
    for sample in samples:
        if sample.oldest_version >= floor:
            kept.append(sample)
        elif max(sample.trajectory.generated_versions, default=-1) >= floor:
            kept.append(dataclasses.replace(sample, min_version=floor))
    return kept, len(samples) - len(kept)


class SeenRollouts:
    """The most recent rollout_ids taken for training, so none is trained twice.

    Bounded: an id older than ``capacity`` admissions is forgotten. Replays that far
    back are prevented by committed Kafka offsets, not by this set.
    """

    def __init__(self, capacity: int) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._capacity = capacity

    def admit(self, rollout_id: str) -> bool:
        """True the first time an id is seen (and remembers it), False after."""
        if rollout_id in self._ids:
            return False
        self._ids[rollout_id] = None
        if len(self._ids) > self._capacity:
            self._ids.popitem(last=False)
        return True


# Produced by collate; consumed by step.rl_step.
@dataclass(frozen=True)
class TrainBatch:
    input_ids: torch.Tensor
    """[B, L] prompt + completion, right-padded with PAD."""
    target_mask: torch.Tensor
    """[B, L-1] 1.0 where target input_ids[:, t+1] is a completion token."""
    behaviour_logprobs: torch.Tensor
    """[B, L-1] aligned with the targets; 0 off the mask."""
    temperature: torch.Tensor
    """[B] sampling temperature the behaviour log-probs were computed at."""
    rewards: tuple[float, ...]
    groups: tuple[str, ...]
    advantages: tuple[float, ...] | None = None
    """Computed before the step by a baseline that outlives batches (trainer/baseline.py);
    None: leave-one-out over ``groups``, in the step."""
    router_choices: torch.Tensor | None = None
    """[B, L, layers, top_k] experts the sampler chose at each position, replayed by the
    trainer's forwards (trainer/router_replay.py); None: re-routed."""

    def select(self, rows: Sequence[int], width: int | None = None) -> TrainBatch:
        """The batch's ``rows`` alone, cut to the first ``width`` positions (by default all):
        what token_logprobs reads of a micro-batch."""
        index = torch.tensor(list(rows), dtype=torch.long)
        end = self.input_ids.shape[1] if width is None else width
        routes = self.router_choices
        return dataclasses.replace(
            self,
            input_ids=self.input_ids[index, :end],
            target_mask=self.target_mask[index, : end - 1],
            behaviour_logprobs=self.behaviour_logprobs[index, : end - 1],
            temperature=self.temperature[index],
            rewards=tuple(self.rewards[i] for i in rows),
            groups=tuple(self.groups[i] for i in rows),
            advantages=None if self.advantages is None else tuple(self.advantages[i] for i in rows),
            router_choices=None if routes is None else routes[index, :end],
        )

    def scored_widths(self) -> list[int]:
        """Each row's positions up to its last scored target (the rest reaches no loss
        under causal attention): at least 1."""
        scored = self.target_mask > 0
        last = torch.where(
            scored.any(dim=1),
            scored.shape[1] - 1 - scored.flip(1).int().argmax(dim=1),
            torch.full((scored.shape[0],), -1),
        )
        return [int(v) + 2 for v in last.tolist()]


def micro_batches(batch: TrainBatch, token_budget: int) -> list[tuple[list[int], int]]:
    """The batch's rows in groups whose padded positions (rows × the group's widest row)
    stay within ``token_budget``: (rows, width) each, longest rows first. A row wider than
    the budget is a group of its own, so memory is bounded by the longest rollout, not by
    the batch."""
    widths = batch.scored_widths()
    groups: list[tuple[list[int], int]] = []
    for row in sorted(range(len(widths)), key=lambda i: -widths[i]):
        if groups and (len(groups[-1][0]) + 1) * groups[-1][1] <= token_budget:
            groups[-1][0].append(row)
        else:
            groups.append(([row], widths[row]))
    return [(sorted(rows), width) for rows, width in groups]


def alignments(samples: Sequence[TrainSample]) -> list[TargetAlignment]:
    """Each sample's training row: collate's layout, read by the mismatch probe as well."""
    return [targets(sample.trajectory) for sample in samples]


def collate(samples: Sequence[TrainSample]) -> TrainBatch:
    if not samples:
        raise ValueError("empty batch")
    rows = alignments(samples)
    width = max(len(row.input_ids) for row in rows)
    input_ids = torch.full((len(samples), width), PAD, dtype=torch.long)
    target_mask = torch.zeros(len(samples), width - 1)
    behaviour = torch.zeros(len(samples), width - 1)
    for index, row in enumerate(rows):
        input_ids[index, : len(row.input_ids)] = torch.tensor(row.input_ids)
        floor = samples[index].min_version
        for run in row.runs:
            if floor:
                fresh = [1.0 if v >= floor else 0.0 for v in run.segment.versions]
                target_mask[index, run.start : run.end] = torch.tensor(fresh)
            else:
                target_mask[index, run.start : run.end] = 1.0
            behaviour[index, run.start : run.end] = torch.tensor(run.segment.logprobs)
    return TrainBatch(
        input_ids=input_ids,
        target_mask=target_mask,
        behaviour_logprobs=behaviour,
        temperature=torch.tensor([s.temperature for s in samples]),
        rewards=tuple(s.reward for s in samples),
        groups=tuple(s.group for s in samples),
        router_choices=collate_routes(samples, width),
    )


def collate_routes(samples: Sequence[TrainSample], width: int) -> torch.Tensor | None:
    """The batch's routes [B, width, layers, top_k], when every rollout carries them (else
    None: a batch is replayed whole or re-routed whole). A position the sampler never ran
    (a row's last token, its padding) takes experts 0..k-1: under causal attention its
    output reaches no scored log-prob."""
    if any(s.router_choices is None for s in samples):
        return None
    routes = [unpack_routes(s.router_choices) for s in samples if s.router_choices is not None]
    layers, top_k = routes[0].shape[1:]
    out = torch.arange(top_k, dtype=routes[0].dtype).repeat(len(samples), width, layers, 1)
    for row, rollout_routes in enumerate(routes):
        out[row, : rollout_routes.shape[0]] = rollout_routes
    return out
