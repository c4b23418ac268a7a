"""`rtrl up` and `rtrl down`: start the supervisor detached, wait for health, stop it all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rtrl import procs
from rtrl.ops import health, run_pin, statedir
from rtrl.ops.stack import StackConfig, StackFile, stack_path


class StackError(RuntimeError):
    pass


def warm_start(state_dir: Path, console: Console, **recipe: Any) -> Path:
    """Train (or find cached) the warm-start policy, with a progress bar. ``recipe``: what
    simulator.warmstart.ensure_warm_start takes besides (the agent's shape and curriculum)."""
    from rtrl.simulator.warmstart import ensure_warm_start  # torch import: only when needed

    with Progress(
        TextColumn("[bold]warm start[/] {task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        task = progress.add_task("supervised stage", total=None)

        def on_step(step: int, total: int, loss: float) -> None:
            progress.update(task, completed=step, total=total, description=f"loss {loss:.3f}")

        path = ensure_warm_start(state_dir, progress=on_step, **recipe)
        progress.update(task, description=f"cached at {path.name}")
    return path


def _pinned_run(state_dir: Path, model_dir: Path | None) -> run_pin.RunPin:
    """The run state_dir holds (run_pin.py): pinned now to ``model_dir`` on its first start,
    otherwise resumed whatever it trains; its model checked to open as a checkpoint."""
    chosen = str(model_dir.resolve()) if model_dir is not None else None
    if chosen is not None:
        _check_opens(chosen, "--model")
    try:
        run = run_pin.pin(state_dir, chosen, os.environ)
    except run_pin.PinMismatch as exc:
        raise StackError(str(exc)) from None
    if run.model_dir is not None and run.model_dir != chosen:
        _check_opens(run.model_dir, f"the run's model {run.model_dir}")
    return run


def _check_opens(model_dir: str, named: str) -> None:
    """StackError, saying which model, unless ``model_dir`` opens as a checkpoint."""
    from rtrl.checkpoint import Checkpoint, CheckpointError

    try:
        Checkpoint.open(model_dir)
    except CheckpointError as exc:
        raise StackError(f"{named}: {exc}") from None


def health_table(rows: list[health.ComponentHealth]) -> Table:
    table = Table(title="rtrl embedded stack", title_justify="left")
    table.add_column("component")
    table.add_column("health")
    table.add_column("detail")
    for row in rows:
        table.add_row(
            row.name, "[green]healthy[/]" if row.healthy else "[yellow]waiting[/]", row.detail
        )
    return table


def up(
    state_dir: Path,
    console: Console,
    config: StackConfig | None = None,
    *,
    fresh: bool = False,
    model_dir: Path | None = None,
) -> StackFile:
    """Start the stack on state_dir: resume the run it holds (lineage, registry, blobs,
    checkpoint and journal, API keys, ClickHouse), or with ``fresh`` start over from the
    warm start. Only the memory-only broker's topics are new either way. ``model_dir``
    (a Hugging Face model directory) is the policy every service serves and trains instead
    of the warm-started demo policy; a run keeps the model it began with."""
    config = config or StackConfig()
    state_dir = state_dir.resolve()
    running = health.running_stack(state_dir)
    if running is not None:
        console.print(
            f"stack already running (supervisor pid {running.supervisor_pid}); `rtrl down` stops it"
        )
        return running
    _prepare(state_dir, console, fresh)
    supervisor = _start_supervisor(state_dir, _policy_env(state_dir, console, model_dir))
    return _wait_healthy(state_dir, console, supervisor, config.health_timeout_s)


def _prepare(state_dir: Path, console: Console, fresh: bool) -> None:
    """Make state_dir a state directory (emptied first with ``fresh``) and say which run
    it holds."""
    try:
        resumed = statedir.is_state_dir(state_dir) and not fresh
        marker = statedir.prepare(state_dir, fresh=fresh)
    except statedir.NotAStateDir as exc:
        raise StackError(str(exc)) from None
    began = time.strftime("%Y-%m-%d %H:%M", time.localtime(marker.created_ts))
    console.print(
        f"{'resuming' if resumed else 'starting'} the run in {state_dir} "
        f"(lineage began {began}; `rtrl up --fresh` starts over)"
    )


def _policy_env(state_dir: Path, console: Console, model_dir: Path | None) -> dict[str, str]:
    """The supervisor's environment: this environment, the state directory, and the model and
    settings of the run it holds; the warm start trained (or found) when that is the demo
    policy."""
    model_dir = model_dir or (
        Path(os.environ["RTRL_MODEL_DIR"]) if os.environ.get("RTRL_MODEL_DIR") else None
    )
    run = _pinned_run(state_dir, model_dir)
    env = {**run_pin.resumed_environment(run, os.environ), "RTRL_STATE_DIR": str(state_dir)}
    restored = sorted(set(run.settings) - set(os.environ))
    if restored:
        console.print(
            "the run's settings: " + ", ".join(f"{k}={run.settings[k]}" for k in restored)
        )
    if run.model_dir is None:
        env.pop("RTRL_MODEL_DIR", None)
        warm_start(state_dir, console)
    else:
        env["RTRL_MODEL_DIR"] = run.model_dir
        console.print(f"policy: {run.model_dir}")
    return env


def _start_supervisor(state_dir: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """The supervisor, detached in a session of its own, logging to logs/supervisor.out."""
    (state_dir / "logs").mkdir(parents=True, exist_ok=True)
    log = procs.open_log(state_dir / "logs" / "supervisor.out")
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "rtrl.ops.supervisor"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    log.close()
    return supervisor


def _wait_healthy(
    state_dir: Path, console: Console, supervisor: subprocess.Popen[bytes], timeout_s: float
) -> StackFile:
    """The stack once every component is healthy, its health shown live; stopped and
    StackError if the supervisor exits or ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    stack = None
    with Live(console=console, refresh_per_second=4, transient=False) as live:
        while time.monotonic() < deadline:
            if supervisor.poll() is not None:
                raise StackError(
                    f"the supervisor exited with {supervisor.returncode}; see {state_dir / 'logs'}"
                )
            if stack_path(state_dir).exists():
                stack = StackFile.read(
                    stack_path(state_dir)
                )  # re-read: the supervisor records restarts
                rows = health.check(stack)
                live.update(health_table(rows))
                if all(r.healthy for r in rows):
                    return stack
            time.sleep(0.5)
    unhealthy = [r.name for r in health.check(stack)] if stack else ["supervisor"]
    down(state_dir, console)
    raise StackError(
        f"not healthy after {timeout_s:.0f} s: {unhealthy}; logs in {state_dir / 'logs'}"
    )


def down(state_dir: Path, console: Console) -> list[str]:
    """Stop the supervisor (which stops everything it started), then make sure of it.
    Returns the names of processes that had to be force-killed."""
    state_dir = state_dir.resolve()
    path = stack_path(state_dir)
    if not path.exists():
        console.print("no stack running")
        return []
    stack = StackFile.read(path)
    if health.pid_alive(stack.supervisor_pid):
        os.kill(stack.supervisor_pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while health.pid_alive(stack.supervisor_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
    forced = []
    pids = {
        **stack.infra,
        **{s.key: s.pid for s in stack.services},
        "supervisor": stack.supervisor_pid,
    }
    for name, pid in pids.items():
        if pid and health.pid_alive(pid):
            procs.stop_group(pid, timeout_s=5)
            forced.append(name)
    path.unlink(missing_ok=True)
    console.print(f"stack stopped{'; force-killed ' + ', '.join(forced) if forced else ''}")
    return forced
