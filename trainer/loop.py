"""The near-continuous RL loop: consume rewards, train, judge, publish, then commit.

Per candidate: train on every pending rollout, journal the candidate (its rollout ids
and the consumer positions after them), run the eval gate on a copy of its weights,
then either publish that copy as the next treatment version or refuse it and restore
the weights and optimizer state of the published version. The journal records the
outcome; the Kafka offsets of what is final are committed last, for lag monitoring
only: on restart the consumer seeks to the journal's positions (trainer/journal.py
says why offsets alone are not enough). Pending never exceeds steps_per_candidate
batches (polls ask for at most the room left), so a candidate always takes all of it,
in as few optimizer steps of at most batch_size as hold it, and the positions after it
are exact. One gate per candidate, not per optimizer step, is how the trainer catches
up with a backlog. Or it does not catch up (when_behind=shed): it reads everything and
keeps the newest candidate's worth, so a trainer slower than its traffic trains on
fresh rollouts, and the ones it sheds are counted.

The gate runs beside training (trainer/candidate.py): while candidate k is judged,
candidate k+1 trains on top of it, but k+1 is journaled and judged only once k's
verdict is in, so the journal still holds at most one undecided candidate, and only
judged weights are ever published. If k is refused, k+1 trains again from the
published state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import torch
from confluent_kafka import KafkaError, KafkaException, TopicPartition
from google.protobuf.message import DecodeError
from opentelemetry import trace
from transformers import PreTrainedModel

from rtrl import otel, signing
from rtrl.checkpoint import Checkpoint
from rtrl.heartbeat import GateRefusal, TrainerBeat, TrainerMismatch
from rtrl.policy import PolicyConfig, state_dict_fp32
from rtrl.trainer import checkpoint, plugins
from rtrl.trainer import metrics as step_metrics
from rtrl.trainer.baseline import baseline_for
from rtrl.trainer.batch import (
    Drop,
    SeenRollouts,
    TrainSample,
    drop_stale,
    shed_oldest,
    split_even,
    to_sample,
)
from rtrl.trainer.candidate import Candidate, Judge
from rtrl.trainer.config import TrainerSettings
from rtrl.trainer.distributed import World
from rtrl.trainer.evaluation import EvalGate, Suite, Verdict
from rtrl.trainer.journal import Journal, parse_position_key, position_key
from rtrl.trainer.label_free import LabelFreeSuite
from rtrl.trainer.learner import LocalLearner, ShardedLearner
from rtrl.trainer.mismatch import Probe, token_versions
from rtrl.trainer.prompt_suite import PromptFileSuite
from rtrl.trainer.step import StepMetrics, combine
from rtrl.v1 import reward_pb2, trainer_pb2, weights_pb2

log = logging.getLogger("trainer")
_tracer = trace.get_tracer("rtrl.trainer")

CONTROL, TREATMENT = "control", "treatment"
# With nothing pending, commit the offsets of dropped records at most this often.
IDLE_COMMIT_S = 1.0
# Refusals kept in the heartbeat for `rtrl status`.
REFUSALS_SHOWN = 5
# when_behind=shed: most records one consume call asks for (the poll reads on to its deadline).
SHED_READ = 1024


Learner = LocalLearner | ShardedLearner


class WeightPublisher(Protocol):
    """One arm's side of weight_sync (weight_sync.client.Publisher)."""

    def publish(
        self,
        weights: dict[str, torch.Tensor],
        *,
        trained_through_event_ts_ms: int = 0,
        rollouts_trained: int = 0,
        train_step: int = 0,
    ) -> int: ...

    def latest(self) -> int: ...


# Reads the manifest and weights weight_sync holds for (arm, version); used to
# resume when the checkpoint is behind what was published.
FetchWeights = Callable[[str, int], tuple[weights_pb2.Manifest, dict[str, torch.Tensor]]]


# Produced after every step; consumed by the heartbeat (read from another thread,
# so it is replaced whole, never mutated).
class Trainer:
    def __init__(
        self,
        settings: TrainerSettings,
        state_dir: Path,
        consumer,
        publishers: Mapping[str, WeightPublisher],
        fetch_weights: FetchWeights,
        policy_config: PolicyConfig = PolicyConfig(),
        model_dir: Path | None = None,
        on_step: Callable[[trainer_pb2.TrainerStep, int], None] | None = None,
        world: World | None = None,
        dead_letter: Callable[[object, str], None] | None = None,
    ) -> None:
        self.settings = settings
        # Refuses to build without a key: a trainer that cannot check rewards trains on none.
        self.verifier = signing.Verifier(
            signing.parse_public_keys(settings.reward_public_keys), signing.Purpose.REWARD
        )
        self.dead_letter = dead_letter
        """Where refused records go, with the reason (the reward DLQ); None: counted only."""
        self.state_dir = Path(state_dir)
        self.checkpoint_dir = self.state_dir / "trainer"
        self.consumer = consumer
        self.publishers = publishers
        self.fetch_weights = fetch_weights
        self.policy_config = policy_config
        self.model_dir = model_dir
        """The policy to train (a Hugging Face model directory); None: the initial_policy plug-in's."""
        self.policy = Checkpoint.builtin_demo() if model_dir is None else Checkpoint.open(model_dir)
        """The policy's checkpoint (its tokenizer, its shape); start() opens the one it loads."""
        self.step = 0
        self.version = -1
        self.rollouts_trained = 0
        self.pending: list[TrainSample] = []
        self.first_pending_at = 0.0
        self.seen = SeenRollouts(settings.dedup_capacity)
        self.baseline = baseline_for(settings)
        self.drops: Counter[Drop] = Counter()
        self.rewards: deque[float] = deque(maxlen=settings.reward_window_steps)
        self.uncommitted = False
        self.last_commit_at = time.monotonic()
        self.journal = Journal(self.checkpoint_dir)
        self.positions: dict[str, int] = {}
        """Next offset to read per "topic:partition", everything before it consumed."""
        self.cluster_id = ""
        """The broker cluster self.positions are offsets in."""
        self.refused = 0
        self.refusals: deque[GateRefusal] = deque(maxlen=REFUSALS_SHOWN)
        self.on_step = on_step
        self.world = world
        self.dropped_recorded: Counter[Drop] = Counter()
        self.status = TrainerBeat()
        self.in_flight: Candidate | None = None
        """The candidate at the eval gate: trained and journaled, not yet published or refused."""
        self.learner_version: int | None = None
        """The published version the learner's weights equal, None once an optimizer step moved
        them past it: only a step from there measures the train–inference mismatch."""
        self.learner_candidate: int | None = None
        """The step of the candidate whose weights the learner holds untouched (they become
        learner_version when it is published)."""
        self.lag = otel.PositionLag()
        """The consumer's lag, refreshed by the polling thread for the metrics scrape."""

    def start(self) -> None:
        """Load the warm start, make sure both arms have a version, resume if we can."""
        torch.manual_seed(self.settings.seed)
        self.cluster_id = self.consumer.list_topics(timeout=30).cluster_id or ""
        path = self.model_dir or plugins.initial_policy(self.settings)(
            self.state_dir, self.policy_config, self.settings.seed
        )
        self.policy = Checkpoint.open(path)
        # A user's directory may be re-saved under the same name: its bytes name the lineage.
        self.warm_start = (
            path.name
            if self.model_dir is None
            else self.policy.lineage_name(self.state_dir / "cache")
        )
        model = self._load_policy()
        ref_model = self._load_policy()
        ref_model.requires_grad_(False)
        warm = state_dict_fp32(model)
        suite = self._eval_suite(ref_model)
        # Scored before sharding: a sharded model only runs with every rank taking part.
        control = suite.score(ref_model)
        if self.world is None:
            self.learner: Learner = LocalLearner(model, ref_model, self.settings)
        else:
            self.learner = ShardedLearner(model, ref_model, self.settings, self.world)

        if self.publishers[CONTROL].latest() < 0:
            self.publishers[CONTROL].publish(warm)
            log.info("published the warm start %s as control v0", path.name)
        latest = self.publishers[TREATMENT].latest()
        if latest < 0:
            self.version = self.publishers[TREATMENT].publish(warm)
            log.info("published the warm start %s as treatment v%d", path.name, self.version)
            # A new registry is a new lineage: a checkpoint or journal left from an earlier one must not be resumed.
            self.journal.reset(version=self.version)
            self.save_checkpoint()
        else:
            self._resume(latest)
        self.learner.remember()
        self.learner_version = self.version
        published = control if self.version == 0 else suite.score(self.learner.eval_model())
        self.gate = EvalGate(
            suite, self.settings.eval_tolerance, control=control, published=published
        )
        log.info(
            "eval gate: control %s, published v%d %s",
            control.as_dict(),
            self.version,
            published.as_dict(),
        )
        self.consumer.subscribe([self.settings.topic], on_assign=self._on_assign)
        self.status = self._status(None)

    def _eval_suite(self, initial: PreTrainedModel) -> Suite:
        """Your prompt file and checker (trainer/prompt_suite.py) if named, else the suite
        plug-in named in the settings, else the label-free one (trainer/label_free.py)."""
        if self.settings.eval_prompts is not None:
            return PromptFileSuite(
                self.policy,
                self.settings.eval_prompts,
                self.settings.eval_checker,
                max_new_tokens=self.settings.eval_max_new_tokens,
                seed=self.settings.seed,
            )
        if not self.settings.eval_suite:
            log.info("eval gate: label-free (KL to the initial policy on held-out answers)")
            return LabelFreeSuite(
                self.policy,
                initial,
                samples=min(self.settings.eval_tasks, 16),
                max_new_tokens=min(self.settings.eval_max_new_tokens, 32),
                seed=self.settings.seed,
            )
        return plugins.eval_suite(self.settings)

    def _load_policy(self) -> PreTrainedModel:
        """A fresh copy of the initial policy, in the trainer's dtype and on its device."""
        return self.policy.load_model(self.settings.dtype, self.settings.device)

    def _resume(self, latest: int) -> None:
        saved = checkpoint.load(self.checkpoint_dir)
        if saved is not None and (saved.warm_start != self.warm_start or saved.version > latest):
            log.warning(
                "ignoring checkpoint v%d from warm start %s: not in this registry's lineage",
                saved.version,
                saved.warm_start,
            )
            saved = None
        if saved is not None:
            self.baseline.load(self.checkpoint_dir)
        if saved is not None and saved.version == latest:
            self.learner.load(saved.model, saved.optimizer)
            self.step, self.rollouts_trained = saved.step, saved.rollouts_trained
            log.info("resumed from checkpoint at step %d, treatment v%d", self.step, latest)
        else:
            # Published past the checkpoint (or have none): continue from what the fleet serves.
            manifest, weights = self.fetch_weights(TREATMENT, latest)
            # Adam moments a few steps old beat starting them from zero.
            self.learner.load(weights, saved.optimizer if saved is not None else None)
            self.step, self.rollouts_trained = manifest.train_step, manifest.rollouts_trained
            log.info(
                "resumed from published treatment v%d at step %d (checkpoint: %s)",
                latest,
                self.step,
                saved and f"v{saved.version}",
            )
        self.version = latest
        replayed = self.journal.replay(latest)
        if replayed.in_flight_published:
            self.journal.published(replayed.step, latest)
            log.info(
                "the candidate of step %d was published as v%d before the crash",
                replayed.step,
                latest,
            )
        elif replayed.last_published_version != latest:
            log.warning(
                "journal ends at v%d but the registry holds v%d: resuming from the journal's "
                "last positions (the committed offsets where it has none); "
                "rollouts since may be retrained",
                replayed.last_published_version,
                latest,
            )
        # Refused candidates advance the step counter without a version.
        self.step = max(self.step, replayed.step)
        self.positions = dict(replayed.positions)
        if self.positions and replayed.cluster_id != self.cluster_id:
            log.warning(
                "the broker is new (cluster %r; the journal's positions are in %r): "
                "its topics start empty, so the journal's positions are not applied; "
                "whatever the old broker held and was not yet trained on is gone with it",
                self.cluster_id,
                replayed.cluster_id,
            )
            self.positions = {}
        for rollout_id in replayed.recent_ids:
            self.seen.admit(rollout_id)
        log.info(
            "resuming at %s with %d recent rollout ids",
            self.positions or "the committed offsets",
            len(replayed.recent_ids),
        )

    def _on_assign(self, consumer, partitions: list[TopicPartition]) -> None:
        for partition in partitions:
            resume = self.positions.get(position_key(partition.topic, partition.partition))
            if resume is not None:
                partition.offset = resume
        consumer.assign(partitions)

    def run(self, stop: threading.Event) -> None:
        self.judge = Judge(self.gate, self._load_policy(), background=self.pipelined)
        try:
            while not stop.is_set():
                self.poll()
                self.lag.refresh(self.consumer, time.monotonic())
                self._refresh_counters()
                self._settle(block=False)
                now = time.monotonic()
                if self.due(now):
                    self.train_pending()
                elif (
                    not self.pending
                    and self.in_flight is None
                    and self.uncommitted
                    and now - self.last_commit_at >= IDLE_COMMIT_S
                ):
                    self.commit()
            self._settle(block=True)
        finally:
            self.judge.close()
        # A partial batch is left untrained and uncommitted: the next run reads it again.
        if not self.pending:
            self.commit()
        self.save_checkpoint()

    @property
    def pipelined(self) -> bool:
        """Whether the eval gate judges beside training (one process only: a sharded learner's
        state lives on every rank, so it is judged inline)."""
        return self.settings.overlap_eval and isinstance(self.learner, LocalLearner)

    @property
    def capacity(self) -> int:
        """Most rollouts one candidate holds."""
        return self.settings.batch_size * self.settings.steps_per_candidate

    def poll(self) -> None:
        """Read up to the room left in the candidate: wait at most poll_timeout_s for the first
        records, then take whatever else the consumer already holds (most of a backlog's records
        can be the control arm's, dropped here: one read of `room` would leave the candidate
        half full while the rest waits for the next gate). Shedding (when_behind=shed), read
        everything there is until the deadline and keep the newest candidate's worth."""
        shedding = self.settings.when_behind == "shed"
        deadline = time.monotonic() + self.settings.poll_timeout_s
        timeout = self.settings.poll_timeout_s
        while (room := SHED_READ if shedding else self.capacity - len(self.pending)) > 0:
            messages = self.consumer.consume(num_messages=room, timeout=timeout)
            self._take(messages)
            if not messages or time.monotonic() >= deadline:
                break
            timeout = 0
        if shedding:
            # Everything read is consumed: what is shed is final, and the positions after the
            # next candidate still cover exactly what it holds or dropped.
            self.pending, shed = shed_oldest(self.pending, self.capacity)
            if shed:
                self.drops[Drop.SHED] += shed

    def _take(self, messages: list) -> None:
        read_ts_ms = int(time.time() * 1000)
        for message in messages:
            if message.error() is not None:
                raise KafkaException(message.error())
            self.uncommitted = True
            self.positions[position_key(message.topic(), message.partition())] = (
                message.offset() + 1
            )
            problem = self.verifier.problem(message.value(), message.headers())
            if problem is not None:
                # Not the joiner's: never trained on, whatever it says.
                self.drops[Drop.UNSIGNED if problem == signing.UNSIGNED else Drop.FORGED] += 1
                if self.dead_letter is not None:
                    self.dead_letter(message, problem)
                continue
            try:
                record = reward_pb2.RewardRecord.FromString(message.value())
            except DecodeError:
                self.drops[Drop.MALFORMED] += 1
                continue
            sample = to_sample(
                record,
                self.policy.max_positions,
                self.baseline.context_of,
                vocab_size=self.policy.spec.vocab_size,
            )
            if isinstance(sample, TrainSample) and not self.seen.admit(sample.rollout_id):
                sample = Drop.DUPLICATE
            if isinstance(sample, Drop):
                self.drops[sample] += 1
                continue
            if not self.pending:
                self.first_pending_at = time.monotonic()
            self.pending.append(
                replace(sample, reward_ts_ms=max(message.timestamp()[1], 0), read_ts_ms=read_ts_ms)
            )

    def due(self, now: float) -> bool:
        n = len(self.pending)
        return n >= self.settings.batch_size or (
            n >= self.settings.min_batch and now - self.first_pending_at >= self.settings.max_wait_s
        )

    def train_pending(self) -> None:
        """Train everything pending as the next candidate (as few optimizer steps of at most
        batch_size as hold it), journal it and hand it to the eval gate; it ships or is
        refused once the verdict is in (_settle)."""
        started, started_ns = time.monotonic(), time.time_ns()
        batch_wait_s = started - self.first_pending_at
        staleness = tuple(self.version - sample.oldest_version for sample in self.pending)
        fresh, stale = drop_stale(self.pending, self.version, self.settings.max_staleness)
        self.pending = []
        positions = dict(self.positions)
        if stale:
            self.drops[Drop.STALE] += stale
        if not fresh:
            if self.in_flight is None:
                self.commit()
            return
        batches = split_even(fresh, self.settings.batch_size)
        metrics, gate_wait_s = self._train(batches)
        self.step += 1
        self.learner_candidate = self.step
        self.journal.candidate(
            self.step, positions, (sample.rollout_id for sample in fresh), self.cluster_id
        )
        optimizer_state: dict[str, Any] | None = None
        if self.pipelined:
            assert isinstance(self.learner, LocalLearner)  # as pipelined says
            weights, optimizer_state = self.learner.snapshot()
        else:
            weights = self.learner.weights()
        handed_over = time.monotonic()
        self.in_flight = Candidate(
            step=self.step,
            base_version=self.version,
            samples=tuple(fresh),
            positions=positions,
            metrics=metrics,
            optimizer_steps=len(batches),
            staleness=staleness,
            started_ns=started_ns,
            batch_wait_s=batch_wait_s,
            step_s=handed_over - started - gate_wait_s,
            gate_wait_s=gate_wait_s,
            judging_since=handed_over,
            weights=weights,
            optimizer_state=optimizer_state,
            verdict=self.judge.submit(weights),
        )
        if not self.pipelined:
            self._settle(block=True)

    def _train(self, batches: list[list[TrainSample]]) -> tuple[StepMetrics, float]:
        """Optimizer steps over the batches, on top of the candidate being judged if there is
        one; returns their metrics and the seconds spent waiting for that candidate's verdict.
        A verdict that comes in meanwhile is acted on between steps, so a version ships
        without waiting for the next candidate; if the base is refused, train again."""
        gate_wait_s = 0.0
        while True:
            results = []
            for batch in batches:
                probe = Probe(
                    token_versions(batch), self.learner_version, self.settings.mismatch_threshold
                )
                results.append(self.learner.step(self.baseline.collate(batch), probe))
                self.learner_version = self.learner_candidate = None
                if self._settle(block=False) is False:
                    break
            else:
                waiting_since = time.monotonic()
                settled = self._settle(block=True)
                gate_wait_s += time.monotonic() - waiting_since
                if settled is not False:
                    return combine(results), gate_wait_s
            log.info(
                "training %d rollouts again on v%d: the candidate they were built on was refused",
                sum(map(len, batches)),
                self.version,
            )

    def _settle(self, block: bool) -> bool | None:
        """Act on the verdict of the candidate at the gate if it is in (with block, wait for it):
        True if it shipped, False if refused, None if there was nothing to act on."""
        candidate = self.in_flight
        if candidate is None or not (block or candidate.verdict.done()):
            return None
        self.in_flight = None
        verdict = candidate.verdict.result()
        self._finalize(candidate, verdict)
        return verdict.accepted

    def _finalize(self, candidate: Candidate, verdict: Verdict) -> None:
        """Publish or refuse, then the step record, span, status and log line."""
        judged = time.monotonic()
        timings = {
            "batch_wait": candidate.batch_wait_s,
            "step": candidate.step_s,
            "gate_wait": candidate.gate_wait_s,
            "eval": judged - candidate.judging_since,
        }
        fresh = candidate.samples
        newest = max(fresh, key=lambda sample: sample.last_event_ts_ms)
        span = _tracer.start_span(
            "trainer.step",
            links=otel.links(s.traceparent for s in fresh),
            start_time=candidate.started_ns,
        )
        with trace.use_span(span, end_on_exit=True):
            if verdict.accepted:
                self._publish(candidate, verdict)
                timings["publish"] = time.monotonic() - judged
            else:
                self._refuse(verdict, len(fresh))
                self.commit(candidate.positions)
            span.set_attributes(
                {
                    "rtrl.trainer.step": candidate.step,
                    "rtrl.policy.base_version": candidate.base_version,
                    "rtrl.policy.version": self.version,
                    "rtrl.trainer.published": verdict.accepted,
                    "rtrl.trainer.rollouts": len(fresh),
                }
            )
            record = step_metrics.step_record(
                lineage=self.warm_start,
                step=candidate.step,
                base_version=candidate.base_version,
                version=self.version if verdict.accepted else -1,
                ts_ms=int(time.time() * 1000),
                metrics=candidate.metrics,
                verdict=verdict,
                staleness=candidate.staleness,
                dropped=self._dropped_since_last_record(),
                timings=timings,
                traceparent=otel.traceparent_of(span),
                newest=newest,
                started_ts_ms=candidate.started_ns // 1_000_000,
                optimizer_steps=candidate.optimizer_steps,
                mismatch_threshold=self.settings.mismatch_threshold,
            )
        self.status = self._status(
            candidate.metrics,
            verdict,
            batch_wait_s=candidate.batch_wait_s,
            step_s=candidate.step_s,
            eval_s=timings["eval"],
            publish_s=timings.get("publish"),
            event_to_publish_s=time.time() - newest.last_event_ts_ms / 1000
            if verdict.accepted and newest.last_event_ts_ms
            else None,
        )
        if self.on_step is not None:
            self.on_step(record, self.version)
        metrics = candidate.metrics
        log.info(
            "step %d -> %s rollouts %d in %d steps reward %.3f kl %.4f entropy %.3f "
            "grad_norm %.3f clipped %.3f stale %d eval %s %s",
            candidate.step,
            f"v{self.version}" if verdict.accepted else "refused",
            metrics.rollouts,
            candidate.optimizer_steps,
            metrics.reward_mean,
            metrics.kl,
            metrics.entropy,
            metrics.grad_norm,
            metrics.clipped_fraction,
            sum(s > self.settings.max_staleness for s in candidate.staleness),
            verdict.candidate.as_dict(),
            " ".join(f"{phase} {seconds:.3f}s" for phase, seconds in timings.items()),
        )

    def _publish(self, candidate: Candidate, verdict: Verdict) -> None:
        """Ship exactly the judged weights; they become what a refusal returns to."""
        fresh = candidate.samples
        self.version = self.publishers[TREATMENT].publish(
            candidate.weights,
            trained_through_event_ts_ms=max(sample.last_event_ts_ms for sample in fresh),
            rollouts_trained=self.rollouts_trained + len(fresh),
            train_step=candidate.step,
        )
        self.journal.published(candidate.step, self.version)
        self.rollouts_trained += len(fresh)
        self.gate.accept(verdict)
        if self.learner_candidate == candidate.step:
            self.learner_version = self.version
        published = None
        if candidate.optimizer_state is None:
            self.learner.remember()
        else:
            assert isinstance(
                self.learner, LocalLearner
            )  # only a pipelined candidate carries optimizer state
            published = (candidate.weights, candidate.optimizer_state)
            self.learner.remember(published)
        self.commit(candidate.positions)
        if candidate.step % self.settings.checkpoint_every == 0:
            self.save_checkpoint(published)
        self.rewards.append(candidate.metrics.reward_mean)

    def _dropped_since_last_record(self) -> dict[str, int]:
        delta = {
            str(reason): n - self.dropped_recorded[reason]
            for reason, n in self.drops.items()
            if n > self.dropped_recorded[reason]
        }
        self.dropped_recorded = self.drops.copy()
        return delta

    def _refuse(self, verdict: Verdict, rollouts: int) -> None:
        """Back to the published version's weights and optimizer state; the batch stays consumed."""
        self.journal.refused(self.step, verdict.summary())
        self.learner.restore()
        self.learner_version, self.learner_candidate = self.version, None
        self.refused += 1
        gate = verdict.as_gate()
        self.refusals.append(
            GateRefusal(
                step=self.step,
                ts_ms=int(time.time() * 1000),
                rollouts=rollouts,
                accepted=gate.accepted,
                candidate=gate.candidate,
                published=gate.published,
                control=gate.control,
                regressions=gate.regressions,
            )
        )
        log.warning(
            "eval gate refused the candidate of step %d (%d rollouts); v%d stays: %s",
            self.step,
            rollouts,
            self.version,
            "; ".join(verdict.regressions),
        )

    def commit(self, positions: Mapping[str, int] | None = None) -> None:
        """Commit the offsets of what is final: these positions (records read past them may be
        pending or in a candidate not yet judged), or without them everything consumed."""
        if self.uncommitted:
            offsets = None
            if positions is not None:
                offsets = [
                    TopicPartition(*parse_position_key(key), offset)
                    for key, offset in positions.items()
                ]
            try:
                if offsets:
                    self.consumer.commit(offsets=offsets, asynchronous=False)
                elif positions is None:
                    self.consumer.commit(asynchronous=False)
            except KafkaException as exc:
                # Nothing consumed on any assigned partition since the last commit.
                if exc.args[0].code() != KafkaError._NO_OFFSET:
                    raise
            self.uncommitted = positions is not None and dict(positions) != self.positions
        self.last_commit_at = time.monotonic()

    def save_checkpoint(self, state: tuple[dict[str, torch.Tensor], dict] | None = None) -> None:
        """state: the published weights and optimizer state when the learner holds newer,
        unjudged ones (by default the learner's own)."""
        weights, optimizer_state = state if state is not None else self.learner.state()
        checkpoint.save(
            self.checkpoint_dir,
            checkpoint.Checkpoint(
                step=self.step,
                version=self.version,
                rollouts_trained=self.rollouts_trained,
                warm_start=self.warm_start,
                model=weights,
                optimizer=optimizer_state,
            ),
        )
        self.baseline.save(self.checkpoint_dir)
        self.journal.compact(self.version, keep_ids=self.settings.dedup_capacity)

    def _status(
        self, metrics: StepMetrics | None, verdict: Verdict | None = None, **latency: float | None
    ) -> TrainerBeat:
        previous = self.status
        return TrainerBeat(
            step=self.step,
            version=self.version,
            rollouts_trained=self.rollouts_trained,
            pending=len(self.pending),
            reward_mean=sum(self.rewards) / len(self.rewards) if self.rewards else None,
            kl=metrics.kl if metrics else previous.kl,
            entropy=metrics.entropy if metrics else previous.entropy,
            grad_norm=metrics.grad_norm if metrics else previous.grad_norm,
            dropped_stale=self.drops[Drop.STALE],
            dropped={str(reason): n for reason, n in self.drops.items()},
            gate=verdict.as_gate() if verdict else previous.gate,
            refused=self.refused,
            refusals=tuple(self.refusals),
            mismatch=self._mismatch(metrics) or previous.mismatch,
            **latency,
        )

    def _mismatch(self, metrics: StepMetrics | None) -> TrainerMismatch | None:
        """The step's train–inference mismatch for the beat; None if it measured no token."""
        if metrics is None or not metrics.mismatch.tokens:
            return None
        gap = metrics.mismatch
        return TrainerMismatch(
            step=self.step,
            mean=gap.mean,
            max=gap.max,
            over_threshold_share=gap.over_threshold_share,
            threshold=self.settings.mismatch_threshold,
            tokens=gap.tokens,
        )

    def _refresh_counters(self) -> None:
        self.status = replace(
            self.status,
            pending=len(self.pending),
            dropped_stale=self.drops[Drop.STALE],
            dropped={str(reason): n for reason, n in self.drops.items()},
        )

    def heartbeat(self) -> TrainerBeat:
        """This trainer's beat (safe to call from another thread: the status is replaced, never changed)."""
        return self.status
