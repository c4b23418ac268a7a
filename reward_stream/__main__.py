"""python -m reward_stream: join rollout telemetry into one RewardRecord per rollout.

Reads telemetry.rollout.v1, telemetry.edit.v1, telemetry.persistence.v1 and
telemetry.followup.v1; writes rl.reward.v1 (+ .late, .dlq). Configured only by
environment variables: RTRL_* (shared stack settings) and RTRL_REWARD_*:
"""

from __future__ import annotations

import sys

from reward_stream.config import RewardStreamSettings
from rtrl.config import StackSettings
from rtrl.runtime import service_process


def usage() -> str:
    lines = [__doc__.strip()]
    for name, field in RewardStreamSettings.model_fields.items():
        lines.append(f"  RTRL_REWARD_{name.upper()} (default {field.default!r}): {field.description}")
    return "\n".join(lines)


def main() -> None:
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(usage())
        return
    settings = RewardStreamSettings()
    stack = StackSettings()
    service_process(shutdown_budget_s=None)
    # Imported after the configuration is parsed so config errors do not wait for faust.
    from reward_stream.app import run
    from rtrl.kafka import ensure_topics, wait_for_broker

    wait_for_broker(stack)
    ensure_topics(stack)
    stack.state_dir.mkdir(parents=True, exist_ok=True)
    run(settings, stack)


if __name__ == "__main__":
    main()
