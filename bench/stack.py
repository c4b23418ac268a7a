"""A throwaway stack for one bench run: Tansu and redis-server in the run's own directory,
so a benchmark measures a fresh broker and nothing another run left behind."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rtrl import procs
from rtrl.config import StackSettings


@contextmanager
def scratch_stack(workdir: Path, **settings: Any) -> Iterator[StackSettings]:
    """Tansu and redis-server logging into ``workdir``, as the StackSettings that reach them
    (state under workdir/state, plus ``settings``); both stopped on the way out, Redis first."""
    tansu = procs.start_tansu(workdir / "tansu.log")
    redis_proc = procs.start_redis(workdir / "redis", workdir / "redis.log")
    try:
        yield StackSettings(
            kafka_bootstrap=f"127.0.0.1:{tansu.port}",
            redis_url=f"redis://127.0.0.1:{redis_proc.port}/0",
            state_dir=workdir / "state",
            **settings,
        )
    finally:
        redis_proc.stop()
        tansu.stop()
