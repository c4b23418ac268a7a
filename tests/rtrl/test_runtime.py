"""A service's process life (rtrl/runtime.py): a stop that hangs ends anyway, saying where."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import textwrap
from pathlib import Path

from rtrl import procs, runtime
from support import wait

# A service whose drain never ends: until_stopped returns on SIGTERM, then the process
# blocks in a function the dump must name.
HANGING_SERVICE = textwrap.dedent("""
    import asyncio, sys, time
    from rtrl.runtime import service_process, until_stopped

    def drain_that_never_ends():
        time.sleep(3600)

    async def serve():
        print("serving", flush=True)
        await until_stopped()
        drain_that_never_ends()

    service_process(shutdown_budget_s=float(sys.argv[1]))
    asyncio.run(serve())
""")


def _start(tmp_path, budget_s: float) -> tuple[procs.Proc, Path]:
    log = tmp_path / "service.log"
    proc = procs.spawn("hanging", [sys.executable, "-c", HANGING_SERVICE, str(budget_s)], log)
    wait.until(
        lambda: "serving" in log.read_text(),
        "the service to start serving",
        watching=[wait.Watched(proc, log)],
    )
    return proc, log


def test_a_stop_that_hangs_is_ended_by_the_watchdog_with_every_stack_in_the_log(tmp_path):
    proc, log = _start(tmp_path, budget_s=1.0)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        status = proc.popen.wait(timeout=30)
    finally:
        proc.stop(timeout_s=1)
    assert status == 1, log.read_text()
    assert "drain_that_never_ends" in log.read_text()


def test_sigusr1_dumps_every_thread_and_the_service_keeps_running(tmp_path):
    proc, log = _start(tmp_path, budget_s=30.0)
    try:

        def main_thread_dumps() -> int:
            """Dumps of the main thread, which waits in the event loop (once per dump)."""
            return log.read_text().count(" in run_forever")

        os.kill(proc.pid, signal.SIGUSR1)
        wait.until(
            main_thread_dumps,
            "a dump of every thread",
            timeout_s=10,
            watching=[wait.Watched(proc, log)],
        )
        assert "most recent call first" in log.read_text()  # faulthandler's header
        # The sentinel: a service still running answers a second SIGUSR1 with a second dump.
        os.kill(proc.pid, signal.SIGUSR1)
        wait.until(
            main_thread_dumps,
            "a second dump: SIGUSR1 must not stop the service",
            ready=lambda dumps: dumps >= 2,
            timeout_s=10,
            watching=[wait.Watched(proc, log)],
        )
        assert proc.popen.poll() is None, "SIGUSR1 must not stop the service"
    finally:
        proc.stop(timeout_s=5)


def test_a_bounded_drain_step_that_ignores_cancellation_is_abandoned_not_awaited(caplog):
    # asyncio.wait_for waits for a cancelled step to finish cancelling; a step that swallows
    # the cancellation (as a gRPC server's shutdown can) would then hold the stop forever.
    async def scenario() -> tuple[bool, object]:
        release = asyncio.Event()

        async def stubborn() -> str:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                await release.wait()
            return "finished"

        step = asyncio.ensure_future(runtime.bounded("stubborn step", stubborn(), 0.05))
        done, _ = await asyncio.wait({step}, timeout=10)
        release.set()
        return bool(done), step.result() if done else step

    with caplog.at_level(logging.WARNING, logger="rtrl.runtime"):
        finished, result = asyncio.run(scenario())
    assert finished, "bounded() waited for a step that ignores cancellation"
    assert result is None
    assert "stubborn step did not finish" in caplog.text


def test_a_bounded_step_that_finishes_returns_its_result():
    async def quick() -> int:
        return 7

    assert asyncio.run(runtime.bounded("quick", quick(), 5)) == 7
