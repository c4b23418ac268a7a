"""The trainer: a supervised warm start, then policy-gradient steps on production
rollouts from rl.reward.v1, publishing each step's weights to weight_sync."""
