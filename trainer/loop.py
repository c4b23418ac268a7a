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

The loop's seams: reading records into samples is trainer/intake.py's; what is told
about each judged candidate (step record, span, heartbeat, log line) is
trainer/report.py's; where a restart picks up is trainer/resume.py's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from rtrl import bulk, otel
from rtrl.checkpoint import Checkpoint
from rtrl.heartbeat import TrainerBeat
from rtrl.policy import PolicyConfig, state_dict_fp32
from rtrl.trainer import checkpoint, plugins
from rtrl.trainer.baseline import baseline_for
from rtrl.trainer.batch import TrainSample, split_even
from rtrl.trainer.candidate import Candidate, Judge, Settled
from rtrl.trainer.config import TrainerSettings
from rtrl.trainer.distributed import World
from rtrl.trainer.evaluation import EvalGate, Suite, Verdict
from rtrl.trainer.intake import Intake
from rtrl.trainer.journal import Journal
from rtrl.trainer.kept_versions import KeptVersions
from rtrl.trainer.label_free import LabelFreeSuite
from rtrl.trainer.learner import Learner, LocalLearner, ShardedLearner
from rtrl.trainer.mismatch import Probe, merge, token_versions
from rtrl.trainer.prompt_suite import PromptFileSuite
from rtrl.trainer.publishing import CONTROL, TREATMENT, FetchWeights, WeightPublisher
from rtrl.trainer.report import Progress, Reporter, StepReport, step_span
from rtrl.trainer.resume import replay_journal, restore_learner, usable_checkpoint
from rtrl.trainer.step import StepMetrics, combine
from rtrl.v1 import trainer_pb2

log = logging.getLogger("trainer")


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
        bulk_store: bulk.BulkStore | None = None,
    ) -> None:
        """dead_letter: where refused records go, with the reason (the reward DLQ); None:
        counted only. on_step: where each judged candidate's step record goes. bulk_store:
        where long rollouts' bulk is read (by default ``<state_dir>/rollout-bulk``)."""
        self.settings = settings
        self.state_dir = Path(state_dir)
        self.checkpoint_dir = self.state_dir / "trainer"
        self.publishers = publishers
        self.fetch_weights = fetch_weights
        self.policy_config = policy_config
        self.model_dir = model_dir
        """The policy to train (a Hugging Face model directory); None: the initial_policy plug-in's."""
        self.policy = Checkpoint.builtin_demo() if model_dir is None else Checkpoint.open(model_dir)
        """The policy's checkpoint (its tokenizer, its shape); start() opens the one it loads."""
        self.world = world
        self.baseline = baseline_for(settings)
        self.intake = Intake(
            settings,
            consumer,
            self.policy,
            self.baseline.context_of,
            dead_letter,
            bulk_store or bulk.BulkStore(self.state_dir / "rollout-bulk"),
        )
        self.reporter = Reporter(settings, on_step)
        self.journal = Journal(self.checkpoint_dir)
        self.step = 0
        self.version = -1
        self.rollouts_trained = 0
        self.in_flight: Candidate | None = None
        """The candidate at the eval gate: trained and journaled, not yet published or refused."""
        self.learner_version: int | None = None
        """The published version the learner's weights equal, None once an optimizer step moved
        them past it: only a step from there measures the train–inference mismatch."""
        self.kept = KeptVersions(
            settings.mismatch_kept_versions,
            self._load_policy,
            max_bytes=settings.mismatch_kept_mb << 20,
            router_replay=settings.router_replay,
        )
        """Published versions' weights, to measure the mismatch on the tokens each sampled."""
        self.learner_candidate: int | None = None
        """The step of the candidate whose weights the learner holds untouched (they become
        learner_version when it is published)."""

    def start(self) -> None:
        """Load the warm start, make sure both arms have a version, resume if we can."""
        torch.manual_seed(self.settings.seed)
        self.intake.identify_cluster()
        name = self._open_policy()
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
        self._join_registry(warm, name)
        self.learner.remember()
        self.learner_version = self.version
        if self.settings.mismatch_kept_versions:
            self.kept.keep(self.version, self.learner.weights())
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
        self.intake.subscribe()
        self.reporter.show(self.progress())

    def _open_policy(self) -> str:
        """Open the policy to train (model_dir, else the initial_policy plug-in's) and name
        its lineage (the warm start); returns its directory's name."""
        path = self.model_dir or plugins.initial_policy(self.settings)(
            self.state_dir, self.policy_config, self.settings.seed
        )
        self.policy = self.intake.policy = Checkpoint.open(path)
        # A user's directory may be re-saved under the same name: its bytes name the lineage.
        self.warm_start = (
            path.name
            if self.model_dir is None
            else self.policy.lineage_name(self.state_dir / "cache")
        )
        return path.name

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

    def _join_registry(self, warm: dict[str, torch.Tensor], name: str) -> None:
        """Publish the warm start to an arm without a version; resume from treatment's latest
        if it has one."""
        if self.publishers[CONTROL].latest() < 0:
            self.publishers[CONTROL].publish(warm)
            log.info("published the warm start %s as control v0", name)
        latest = self.publishers[TREATMENT].latest()
        if latest >= 0:
            self._resume(latest)
            return
        self.version = self.publishers[TREATMENT].publish(warm)
        log.info("published the warm start %s as treatment v%d", name, self.version)
        # A new registry is a new lineage: a checkpoint or journal left from an earlier one must not be resumed.
        self.journal.reset(version=self.version)
        self.save_checkpoint()

    def _resume(self, latest: int) -> None:
        saved = usable_checkpoint(self.checkpoint_dir, self.warm_start, latest)
        if saved is not None:
            self.baseline.load(self.checkpoint_dir)
        restored = restore_learner(self.learner, saved, latest, self.fetch_weights)
        self.rollouts_trained = restored.rollouts_trained
        self.version = latest
        replayed = replay_journal(self.journal, latest)
        # Refused candidates advance the step counter without a version.
        self.step = max(restored.step, replayed.step)
        self.intake.resume(replayed)

    def run(self, stop: threading.Event) -> None:
        self.judge = Judge(self.gate, self._load_policy(), background=self.pipelined)
        try:
            while not stop.is_set():
                self.intake.poll()
                self.intake.refresh_lag(time.monotonic())
                self.reporter.refresh(len(self.intake.pending), self.intake.drops)
                self._settle(block=False)
                now = time.monotonic()
                if self.intake.due(now):
                    self.train_pending()
                elif self.in_flight is None and self.intake.idle_commit_due(now):
                    self.intake.commit()
            self._settle(block=True)
        finally:
            self.judge.close()
        # A partial batch is left untrained and uncommitted: the next run reads it again.
        if not self.intake.pending:
            self.intake.commit()
        self.save_checkpoint()

    @property
    def pipelined(self) -> bool:
        """Whether the eval gate judges beside training (one process only: a sharded learner's
        state lives on every rank, so it is judged inline)."""
        return self.settings.overlap_eval and isinstance(self.learner, LocalLearner)

    def train_pending(self) -> None:
        """Train everything pending as the next candidate (as few optimizer steps of at most
        batch_size as hold it), journal it and hand it to the eval gate; it ships or is
        refused once the verdict is in (_settle)."""
        started, started_ns = time.monotonic(), time.time_ns()
        taken = self.intake.take(self.version, started)
        if not taken.fresh:
            if self.in_flight is None:
                self.intake.commit()
            return
        batches = split_even(taken.fresh, self.settings.batch_size)
        metrics, gate_wait_s = self._train(batches)
        self.step += 1
        self.learner_candidate = self.step
        self.journal.candidate(
            self.step,
            taken.positions,
            (sample.rollout_id for sample in taken.fresh),
            self.intake.cluster_id,
        )
        weights, optimizer_state = self._hand_over()
        handed_over = time.monotonic()
        self.in_flight = Candidate(
            step=self.step,
            base_version=self.version,
            samples=taken.fresh,
            positions=taken.positions,
            metrics=metrics,
            optimizer_steps=len(batches),
            staleness=taken.staleness,
            started_ns=started_ns,
            batch_wait_s=taken.waited_s,
            step_s=handed_over - started - gate_wait_s,
            gate_wait_s=gate_wait_s,
            judging_since=handed_over,
            weights=weights,
            optimizer_state=optimizer_state,
            verdict=self.judge.submit(weights),
        )
        if not self.pipelined:
            self._settle(block=True)

    def _hand_over(self) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        """The candidate's weights to judge and, judged beside training, a copy of the
        optimizer state that goes with them (the learner trains on meanwhile)."""
        if self.pipelined:
            assert isinstance(self.learner, LocalLearner)  # as pipelined says
            return self.learner.snapshot()
        return self.learner.weights(), None

    def _train(self, batches: list[list[TrainSample]]) -> tuple[StepMetrics, float]:
        """Optimizer steps over the batches, on top of the candidate being judged if there is
        one; returns their metrics and the seconds spent waiting for that candidate's verdict.
        A verdict that comes in meanwhile is acted on between steps, so a version ships
        without waiting for the next candidate; if the base is refused, train again."""
        gate_wait_s = 0.0
        while True:
            results = []
            for batch in batches:
                versions, threshold = token_versions(batch), self.settings.mismatch_threshold
                collated = self.baseline.collate(batch)
                kept = self.kept.measure(collated, versions, threshold, skip=self.learner_version)
                metrics = self.learner.step(
                    collated, Probe(versions, self.learner_version, threshold)
                )
                results.append(replace(metrics, mismatch=merge([metrics.mismatch, kept])))
                self.learner_version = self.learner_candidate = None
                if self._settle(block=False) is Settled.REFUSED:
                    break
            else:
                waiting_since = time.monotonic()
                settled = self._settle(block=True)
                gate_wait_s += time.monotonic() - waiting_since
                if settled is not Settled.REFUSED:
                    return combine(results), gate_wait_s
            log.info(
                "training %d rollouts again on v%d: the candidate they were built on was refused",
                sum(map(len, batches)),
                self.version,
            )

    def _settle(self, block: bool) -> Settled:
        """Act on the verdict of the candidate at the gate if it is in (with block, wait for it)."""
        candidate = self.in_flight
        if candidate is None or not (block or candidate.verdict.done()):
            return Settled.NOTHING
        self.in_flight = None
        verdict = candidate.verdict.result()
        self._finalize(candidate, verdict)
        return Settled.PUBLISHED if verdict.accepted else Settled.REFUSED

    def _finalize(self, candidate: Candidate, verdict: Verdict) -> None:
        """Publish or refuse inside the candidate's span, then report it."""
        judged = time.monotonic()
        publish_s = None
        with step_span(candidate) as span:
            if verdict.accepted:
                self._publish(candidate, verdict)
                publish_s = time.monotonic() - judged
            else:
                self._refuse(verdict, len(candidate.samples))
                self.intake.commit(candidate.positions)
            report = StepReport(
                candidate=candidate,
                verdict=verdict,
                lineage=self.warm_start,
                version=self.version,
                eval_s=judged - candidate.judging_since,
                publish_s=publish_s,
                dropped=self.reporter.unreported(self.intake.drops),
                traceparent=otel.traceparent_of(span),
                ts_ms=int(time.time() * 1000),
            )
            span.set_attributes(report.span_attributes())
        self.reporter.stepped(report, self.progress())

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
        self.kept.keep(self.version, candidate.weights)
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
        self.intake.commit(candidate.positions)
        if candidate.step % self.settings.checkpoint_every == 0:
            self.save_checkpoint(published)

    def _refuse(self, verdict: Verdict, rollouts: int) -> None:
        """Back to the published version's weights and optimizer state; the batch stays consumed."""
        self.journal.refused(self.step, verdict.summary())
        self.learner.restore()
        self.learner_version, self.learner_candidate = self.version, None
        self.reporter.refusal(self.step, verdict, rollouts)
        log.warning(
            "eval gate refused the candidate of step %d (%d rollouts); v%d stays: %s",
            self.step,
            rollouts,
            self.version,
            "; ".join(verdict.regressions),
        )

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

    def progress(self) -> Progress:
        """The counters the heartbeat shows."""
        return Progress(
            step=self.step,
            version=self.version,
            rollouts_trained=self.rollouts_trained,
            pending=len(self.intake.pending),
            drops=dict(self.intake.drops),
        )

    def heartbeat(self) -> TrainerBeat:
        """This trainer's beat (safe to call from another thread: it is replaced, never changed)."""
        return self.reporter.beat
