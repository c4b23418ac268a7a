"""Where a restarted trainer picks up: its checkpoint, what weight_sync published, its journal.

The weight registry is the commit point (trainer/journal.py), so treatment's latest
version is where the learner resumes. The checkpoint is used if it is of this lineage
and at that version; published past it (or with none), the weights come from
weight_sync and only Adam's moments from the checkpoint. The journal then says which
candidate was final, where the consumer reads on and which rollouts are not trained again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from rtrl.trainer import checkpoint
from rtrl.trainer.journal import Journal, Replayed
from rtrl.trainer.learner import Learner
from rtrl.trainer.publishing import TREATMENT, FetchWeights

log = logging.getLogger("trainer")


# Produced by restore_learner; consumed by Trainer._resume.
@dataclass(frozen=True)
class Restored:
    """The counters of the weights the learner was loaded with."""

    step: int
    rollouts_trained: int


def usable_checkpoint(
    directory: Path, warm_start: str, latest: int
) -> checkpoint.Checkpoint | None:
    """The checkpoint in directory if it is of this lineage (this warm start, no version
    past the registry's latest), else None."""
    saved = checkpoint.load(directory)
    if saved is not None and (saved.warm_start != warm_start or saved.version > latest):
        log.warning(
            "ignoring checkpoint v%d from warm start %s: not in this registry's lineage",
            saved.version,
            saved.warm_start,
        )
        return None
    return saved


def restore_learner(
    learner: Learner,
    saved: checkpoint.Checkpoint | None,
    latest: int,
    fetch_weights: FetchWeights,
) -> Restored:
    """Load treatment's latest version into the learner: from the checkpoint if it holds it,
    else from weight_sync."""
    if saved is not None and saved.version == latest:
        learner.load(saved.model, saved.optimizer)
        log.info("resumed from checkpoint at step %d, treatment v%d", saved.step, latest)
        return Restored(saved.step, saved.rollouts_trained)
    # Published past the checkpoint (or have none): continue from what the fleet serves.
    manifest, weights = fetch_weights(TREATMENT, latest)
    # Adam moments a few steps old beat starting them from zero.
    learner.load(weights, saved.optimizer if saved is not None else None)
    log.info(
        "resumed from published treatment v%d at step %d (checkpoint: %s)",
        latest,
        manifest.train_step,
        saved and f"v{saved.version}",
    )
    return Restored(manifest.train_step, manifest.rollouts_trained)


def replay_journal(journal: Journal, latest: int) -> Replayed:
    """The journal's account given the registry's latest version; a candidate published
    just before a crash is recorded as such."""
    replayed = journal.replay(latest)
    if replayed.in_flight_published:
        journal.published(replayed.step, latest)
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
    return replayed
