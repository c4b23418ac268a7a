"""What the run in a state directory trains: the model it began with and the settings that
decide what it trains toward.

`rtrl up` resumes whatever run its state directory holds: the agentic demo (its warm start,
eval suite and reward function), the single-turn demo policy, or a `--model` directory. The
first `rtrl up` (or `rtrl demo`) of a lineage writes the pin; every later one reads it, so a
resumed run serves and trains the same weights under the same reward and gate, and a command
that names another model is told which command resumes the run and which starts a new one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

PIN_FILE = "model.json"
"""In the state directory, owner-only like everything there (it names a path)."""

RUN_SETTINGS = (
    "RTRL_STACK_REWARD_FN_VERSION",
    "RTRL_TRAINER_BASELINE",
    "RTRL_TRAINER_INITIAL_POLICY",
    "RTRL_TRAINER_EVAL_SUITE",
    "RTRL_TRAINER_EVAL_TASKS",
    "RTRL_TRAINER_STEPS_PER_CANDIDATE",
)
"""The settings that decide what a run trains toward (reward function, initial policy,
baseline, eval gate): recorded when the run begins, restored where the environment sets none
when it resumes. An allow-list, so no secret of the environment is ever written down."""


class PinMismatch(RuntimeError):
    pass


# Produced by pin() on a lineage's first start; consumed by every later `rtrl up` and by
# `rtrl demo`, which checks that the run it would resume is its own.
@dataclass(frozen=True)
class RunPin:
    model_dir: str | None
    """The model directory served and trained; None for the demo policy."""
    settings: dict[str, str] = field(default_factory=dict)
    """RUN_SETTINGS as the environment set them when the run began."""

    def describe(self) -> str:
        return self.model_dir or "the demo policy"


def read(state_dir: Path) -> RunPin | None:
    """The run's pin, or None before its first start. Tolerates a pin without settings (written
    before they were recorded)."""
    path = state_dir / PIN_FILE
    if not path.exists():
        return None
    fields = json.loads(path.read_text())
    settings = fields.get("settings") or {}
    return RunPin(
        fields["model_dir"], {k: str(v) for k, v in settings.items() if k in RUN_SETTINGS}
    )


def pin(state_dir: Path, model_dir: str | None, environ: Mapping[str, str]) -> RunPin:
    """The run in ``state_dir``: pinned now to ``model_dir`` and ``environ``'s RUN_SETTINGS if
    it has no pin yet; otherwise the pinned run, which ``model_dir`` must name or leave out
    (None resumes whatever the run trains). Raises PinMismatch naming both commands."""
    pinned = read(state_dir)
    if pinned is not None:
        if model_dir is not None and model_dir != pinned.model_dir:
            raise PinMismatch(
                f"the run in {state_dir} trains {pinned.describe()}, not {model_dir}: "
                f"`rtrl up` resumes it; `rtrl up --fresh --model {model_dir}` starts a new run"
            )
        return pinned
    run = RunPin(model_dir, {name: environ[name] for name in RUN_SETTINGS if name in environ})
    fd = os.open(state_dir / PIN_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"model_dir": run.model_dir, "settings": run.settings}))
    return run


def resumed_environment(run: RunPin, environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with the run's recorded settings wherever it sets none."""
    return {**run.settings, **environ}
