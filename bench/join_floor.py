"""The faust floor of `rtrl bench join`: a bare agent that only counts input records.

python -m rtrl.bench.join_floor OUT EXPECTED. Same faust settings and the same
read path as reward_stream/app.py (one agent over the four telemetry topics, a
noack stream, each event acked at once), so the difference against the joiner is
the join itself and its publishing. Stack settings come from RTRL_* variables and
the group from RTRL_REWARD_APP_ID.

It writes OUT (JSON: events, first_s, last_s in time.time()) twice a second and
once more when EXPECTED events have been counted; the bench stops it. The span from
the first to the last counted event leaves group formation out.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TypedDict

import faust

from rtrl import topics
from rtrl.config import StackSettings
from rtrl.reward_stream.app import faust_app, run_worker
from rtrl.reward_stream.config import RewardStreamSettings


class FloorCount(TypedDict):
    """OUT's document; read by bench.join_readers.faust_floor."""

    events: int
    first_s: float | None
    last_s: float | None


def create_app(
    settings: RewardStreamSettings, stack: StackSettings, out: Path, expected: int
) -> faust.App:
    app = faust_app(settings, stack, "bench_join_floor")
    counted: FloorCount = {"events": 0, "first_s": None, "last_s": None}

    def write() -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(counted))
        tmp.replace(out)

    @app.agent(app.topic(*topics.TELEMETRY), name="count")
    async def count_agent(stream):
        async for event in stream.noack().events():
            now = time.time()
            if counted["first_s"] is None:
                counted["first_s"] = now
            counted["last_s"] = now
            counted["events"] += 1
            event.ack()
            if counted["events"] == expected:
                write()

    @app.timer(0.5, name="report")
    async def report():
        write()

    return app


def main() -> None:
    out, expected = Path(sys.argv[1]).resolve(), int(sys.argv[2])
    settings, stack = RewardStreamSettings(), StackSettings()
    stack.state_dir.mkdir(parents=True, exist_ok=True)  # faust's worker changes into it
    run_worker(create_app(settings, stack, out, expected), stack)


if __name__ == "__main__":
    main()
