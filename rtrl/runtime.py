"""The life of a service process: run until told to stop, or until a background task dies."""

from __future__ import annotations

import asyncio
import signal


async def until_stopped(*tasks: asyncio.Task, stop: asyncio.Event | None = None) -> None:
    """Wait for SIGTERM/SIGINT (or ``stop``), or for any of ``tasks`` to end.

    Returns on a signal. Re-raises the error of a task that failed: a service whose
    heartbeat or consumer loop died should exit, so the supervisor restarts it.
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
    for task in done:
        if task is not stop_wait and not task.cancelled() and task.exception() is not None:
            raise task.exception()
