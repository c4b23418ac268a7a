"""The life of a service process: run until told to stop, or until a background task dies."""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal
import sys
from collections.abc import Awaitable
from typing import TypeVar

SHUTDOWN_BUDGET_S = 45.0
"""Longest a service may take from SIGTERM to exit. Every service bounds each step of its
drain well inside this; the watchdog is for what no step bounds (a library's exit hook,
a thread stuck in C): it writes every thread's stack to the log and ends the process
(exit status 1), so a stop never hangs a supervisor or a test, and the log says where."""


log = logging.getLogger("rtrl.runtime")

T = TypeVar("T")

_watchdog_s: float | None = None
"""Set by service_process(): only a service's own process arms the watchdog (a test that
runs a service's serve() inside pytest must not be ended by it)."""


def owner_only_files() -> None:
    """Everything this process creates from now on is readable by its owner only (state
    files hold prompts, code, follow-ups, journals and secrets)."""
    os.umask(0o077)


def service_process(shutdown_budget_s: float | None = SHUTDOWN_BUDGET_S) -> None:
    """Call first in a service's main(): owner-only files, stack dumps on SIGUSR1, and a
    shutdown watchdog armed when until_stopped returns (None: a service that stops by other
    means than until_stopped, and bounds its own stop)."""
    global _watchdog_s
    _watchdog_s = shutdown_budget_s
    owner_only_files()
    enable_stack_dumps()


def enable_stack_dumps() -> None:
    """``kill -USR1 PID`` writes every thread's stack to the process's stderr (its log):
    where a service that does not answer, or does not stop, is stuck."""
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)


def arm_shutdown_watchdog(budget_s: float = SHUTDOWN_BUDGET_S) -> None:
    """From now on the process has ``budget_s`` to exit (see SHUTDOWN_BUDGET_S)."""
    faulthandler.dump_traceback_later(budget_s, exit=True, file=sys.stderr)


async def until_stopped(*tasks: asyncio.Task, stop: asyncio.Event | None = None) -> None:
    """Wait for SIGTERM/SIGINT (or ``stop``), or for any of ``tasks`` to end.

    Returns on a signal. Re-raises the error of a task that failed: a service whose
    heartbeat or consumer loop died should exit, so the supervisor restarts it. Either
    way, in a service's own process (service_process), the shutdown watchdog is armed
    on return.
    """
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stop_wait = asyncio.create_task(stop.wait())
    try:
        done, _ = await asyncio.wait([stop_wait, *tasks], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop_wait.cancel()
        if _watchdog_s is not None:
            arm_shutdown_watchdog(_watchdog_s)
    for task in done:
        if (
            task is not stop_wait
            and not task.cancelled()
            and (error := task.exception()) is not None
        ):
            raise error


async def bounded(step: str, awaitable: Awaitable[T], timeout_s: float) -> T | None:
    """``awaitable``'s result, or None (logged, naming ``step``) if it has not finished
    within ``timeout_s``: a drain step of a stopping service.

    Unlike ``asyncio.wait_for``, this does not wait for the step to acknowledge its
    cancellation: a step that swallows or ignores it (a gRPC server's shutdown, a C call)
    is cancelled and abandoned, so the bound holds whatever the step does."""
    task = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        task.cancel()
        log.warning("stopping: %s did not finish within %.0f s; going on", step, timeout_s)
        return None
    return task.result()
