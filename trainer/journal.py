"""The trainer's write-ahead journal: which rollouts each step consumed, and how it ended.

Kafka offsets alone cannot make training exactly-once: the publish of a version and
the offset commit are two writes, and a crash between them either retrains a batch
that is already in the fleet's weights or skips one that never got there. So, before
a candidate is judged or published, the trainer appends (and fsyncs) a ``candidate``
entry: the step, the consumer positions after its batch, and the batch's rollout ids.
After the decision it appends ``published`` (with the version) or ``refused`` (with
the eval scores). The weight registry is the commit point:

* a candidate followed by ``published`` or ``refused`` is final;
* a candidate with no outcome was published if and only if the registry holds a
  version newer than the journal's last ``published`` one (one candidate is ever in
  flight, so that version can only be it); otherwise it never left the trainer and
  its rollouts are read and trained again, which is not twice, since the weights
  that held them died with the process.

On restart, the consumer seeks to the positions of the last final entry, and the
ids of every final entry seed the duplicate filter (a record the reward stream
wrote twice must not be trained twice across a restart either).

The file is compacted at checkpoints into one ``base`` entry carrying the last
final positions and the most recent ids, so it stays bounded.

Positions are offsets in one broker cluster, and each entry names it: a memory-only
broker started anew (the embedded stack after `rtrl down`/`up`) has new, empty topics
and a new cluster id, and offsets from the old one must not be applied to them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

FILENAME = "journal.jsonl"

Positions = dict[str, int]
"""``"topic:partition"`` -> next offset to read."""


def position_key(topic: str, partition: int) -> str:
    return f"{topic}:{partition}"


def parse_position_key(key: str) -> tuple[str, int]:
    topic, _, partition = key.rpartition(":")
    return topic, int(partition)


# Produced by Journal.replay; consumed by trainer.resume.replay_journal and Intake.resume.
@dataclass(frozen=True)
class Replayed:
    step: int = 0
    """Step of the last final entry (the step counter continues from here)."""
    positions: Positions = field(default_factory=dict)
    """Where the consumer resumes (empty: from the group's committed offsets)."""
    cluster_id: str = ""
    """The broker cluster the positions are offsets in ("" when unknown)."""
    trained: tuple[str, ...] = ()
    """Rollout ids in published versions since the last compaction, in order."""
    refused: tuple[str, ...] = ()
    """Rollout ids whose candidate the eval gate refused (consumed, never shipped)."""
    last_published_version: int = -1
    recent_ids: tuple[str, ...] = ()
    """Every final id since the last compaction plus the ids the compaction kept."""
    in_flight_published: bool = False
    """The last candidate had no outcome and the registry shows it was published."""


class Journal:
    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / FILENAME
        self._drop_torn_tail()

    def reset(self, *, version: int, step: int = 0) -> None:
        """Start a new lineage (a fresh registry): forget every earlier entry."""
        self._rewrite(
            [
                {
                    "kind": "base",
                    "step": step,
                    "version": version,
                    "positions": {},
                    "cluster_id": "",
                    "ids": [],
                }
            ]
        )

    def candidate(
        self,
        step: int,
        positions: Mapping[str, int],
        rollout_ids: Iterable[str],
        cluster_id: str = "",
    ) -> None:
        self._append(
            {
                "kind": "candidate",
                "step": step,
                "positions": dict(positions),
                "cluster_id": cluster_id,
                "ids": list(rollout_ids),
            }
        )

    def published(self, step: int, version: int) -> None:
        self._append({"kind": "published", "step": step, "version": version})

    def refused(self, step: int, scores: Mapping[str, object]) -> None:
        self._append({"kind": "refused", "step": step, "scores": dict(scores)})

    def replay(self, registry_latest: int) -> Replayed:
        """What the entries say happened, given the registry's latest version."""
        step, positions, cluster_id, version = 0, {}, "", -1
        trained: list[str] = []
        refused: list[str] = []
        kept: list[str] = []
        in_flight: dict | None = None
        for entry in self._entries():
            kind = entry["kind"]
            if kind == "base":
                step, positions, version, kept = (
                    entry["step"],
                    entry["positions"],
                    entry["version"],
                    entry["ids"],
                )
                cluster_id = entry.get("cluster_id", "")
                trained, refused, in_flight = [], [], None
            elif kind == "candidate":
                in_flight = entry
            elif in_flight is not None and entry["step"] == in_flight["step"]:
                (trained if kind == "published" else refused).extend(in_flight["ids"])
                step, positions, cluster_id = (
                    in_flight["step"],
                    in_flight["positions"],
                    in_flight.get("cluster_id", ""),
                )
                if kind == "published":
                    version = entry["version"]
                in_flight = None
        landed = False
        if in_flight is not None and registry_latest > version:
            landed = True
            trained.extend(in_flight["ids"])
            step, positions, version = in_flight["step"], in_flight["positions"], registry_latest
            cluster_id = in_flight.get("cluster_id", "")
        return Replayed(
            step=step,
            positions=positions,
            cluster_id=cluster_id,
            trained=tuple(trained),
            refused=tuple(refused),
            last_published_version=version,
            recent_ids=(*kept, *trained, *refused),
            in_flight_published=landed,
        )

    def compact(self, registry_latest: int, keep_ids: int) -> None:
        """Fold everything final into one base entry (call only between steps)."""
        state = self.replay(registry_latest)
        self._rewrite(
            [
                {
                    "kind": "base",
                    "step": state.step,
                    "version": state.last_published_version,
                    "positions": state.positions,
                    "cluster_id": state.cluster_id,
                    "ids": list(state.recent_ids[-keep_ids:]),
                }
            ]
        )

    def _entries(self) -> Iterable[dict]:
        if not self.path.exists():
            return
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                if line.endswith("\n"):
                    yield json.loads(line)

    def _drop_torn_tail(self) -> None:
        """An append cut short by a crash was never acted on: cut it off, so the next
        append starts on a line of its own."""
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(self.path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)
                f.flush()
                os.fsync(f.fileno())

    def _append(self, entry: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _rewrite(self, entries: list[dict]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{FILENAME}.tmp{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as f:
            for entry in entries:
                f.write(json.dumps(entry, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
