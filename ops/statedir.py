"""The embedded stack's state directory: what marks one, and what `rtrl up` may do to it.

A state directory holds a run's lineage: Redis's append-only file (registry, API keys),
weight blobs, the trainer's checkpoint and journal, chdb's tables, logs. `rtrl up`
resumes it; `rtrl up --fresh` empties it but for the warm-start cache. Neither ever
touches a directory it cannot tell is one: ``RTRL_STATE_DIR=.`` in a checkout, or a
scratch directory holding other files, is refused, not emptied.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

MARKER = ".rtrl-state"
FORMAT = 1

# Kept by --fresh: the warm start costs a minute to train and depends on nothing else.
KEPT_BY_FRESH = frozenset({"cache", MARKER})

# Everything an rtrl stack writes at the top of its state directory. A directory
# holding only these (and no marker) is one that an rtrl from before the marker wrote.
STACK_ENTRIES = frozenset(
    {
        "cache",
        "logs",
        "chdb",
        "blobs",
        "trainer",
        "redis",
        "otel",
        "reward_stream",
        "stack.json",
        "stack.tmp",
        "broker.json",
        "broker.tmp",
        "model.json",
        MARKER,
    }
)


class NotAStateDir(RuntimeError):
    pass


# Produced by prepare; written to <state_dir>/.rtrl-state.
@dataclass(frozen=True)
class Marker:
    format: int
    created_ts: float
    """When the lineage in this directory began (the last --fresh or the first up)."""


def is_state_dir(state_dir: Path) -> bool:
    return (state_dir / MARKER).is_file()


def foreign_entries(state_dir: Path) -> list[str]:
    """Entries of a directory without a marker that no rtrl stack writes."""
    if not state_dir.is_dir():
        return []
    return sorted(entry.name for entry in state_dir.iterdir() if entry.name not in STACK_ENTRIES)


def prepare(state_dir: Path, *, fresh: bool) -> Marker:
    """Make state_dir ready for `rtrl up`: resume what it holds, or (``fresh``) empty it
    but for the warm-start cache. Raises NotAStateDir for a non-empty directory that is
    not a state directory, before touching anything in it."""
    if state_dir.exists() and not state_dir.is_dir():
        raise NotAStateDir(f"{state_dir} is a file, not a state directory")
    if state_dir.is_dir() and not is_state_dir(state_dir):
        foreign = foreign_entries(state_dir)
        if foreign:
            shown = ", ".join(foreign[:5]) + (", …" if len(foreign) > 5 else "")
            raise NotAStateDir(
                f"{state_dir} is not empty and is not an rtrl state directory (no {MARKER}; it holds {shown}). "
                "Point RTRL_STATE_DIR at an empty or new directory; rtrl never empties a directory it did not create."
            )
    state_dir.mkdir(parents=True, exist_ok=True)
    state_dir.chmod(0o700)  # prompts, code, follow-ups, keys: the owner's alone
    if fresh:
        for entry in state_dir.iterdir():
            if entry.name in KEPT_BY_FRESH:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    marker_path = state_dir / MARKER
    if marker_path.is_file() and not fresh:
        return Marker(**json.loads(marker_path.read_text()))
    marker = Marker(format=FORMAT, created_ts=time.time())
    marker_path.write_text(json.dumps(asdict(marker)) + "\n")
    marker_path.chmod(0o600)
    return marker
