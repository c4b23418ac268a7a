"""reward_stream: joins each rollout's telemetry and emits exactly one RewardRecord per rollout."""
