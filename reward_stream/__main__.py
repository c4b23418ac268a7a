"""``python -m rtrl.reward_stream``: join rollout telemetry into one RewardRecord per rollout.

Reads telemetry.rollout.v1, telemetry.edit.v1, telemetry.persistence.v1 and
telemetry.followup.v1; writes rl.reward.v1 (+ .late, .dlq).
"""

from __future__ import annotations

from rtrl import entrypoint
from rtrl.config import StackSettings
from rtrl.reward_stream.config import RewardStreamSettings
from rtrl.runtime import service_process


def main() -> None:
    settings, stack = entrypoint.parse_settings(
        "python -m rtrl.reward_stream",
        __doc__,
        RewardStreamSettings,
        StackSettings,
        required=RewardStreamSettings.required_secrets,
    )
    entrypoint.configure_logging()
    service_process(shutdown_budget_s=None)
    # Imported after the configuration is parsed so config errors do not wait for faust.
    from rtrl.kafka import ensure_topics, wait_for_broker
    from rtrl.reward_stream.app import run

    wait_for_broker(stack)
    ensure_topics(stack)
    stack.state_dir.mkdir(parents=True, exist_ok=True)
    run(settings, stack)


if __name__ == "__main__":
    main()
