"""Settings of the reward_stream service (env prefix RTRL_REWARD_)."""

from __future__ import annotations

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from rtrl import signing
from rtrl.config import MacKey, MacKeys, RequiredSecret, Settings, StackSettings
from rtrl.reward_stream.effort import EffortCurve
from rtrl.reward_stream.join import JoinConfig


class RewardStreamSettings(Settings):
    """Settings of the reward join (env prefix ``RTRL_REWARD_``)."""

    model_config = SettingsConfigDict(env_prefix="RTRL_REWARD_")

    window_s: float = Field(2.0, gt=0)
    """How long after a rollout's first event its user signals are collected."""

    grace_s: float = Field(0.5, ge=0)
    """Event-time allowance for out-of-order events before the window closes (<= window_s)."""

    deadline_slack_s: float = Field(1.0, ge=0)
    """Wall-clock slack after the window before a rollout on an idle partition settles anyway."""

    tick_interval_s: float = Field(0.25, gt=0, le=10)
    """How often the wall-clock deadline is checked."""

    max_wait_s: float = Field(3960.0, gt=0)
    """How long to wait for a missing RolloutRecord before dropping the rollout. An agent's
    record is written when its trajectory ends, and the product's telemetry about it (an
    edit shown at its third turn) may arrive long before: at least the workers'
    RTRL_INFERENCE_TRAJECTORY_MAX_S plus RTRL_INFERENCE_TRAJECTORY_IDLE_S (3600 + 300 by
    default) and a minute. A rollout waiting holds only its telemetry."""

    settled_ttl_s: float = Field(600.0, ge=0)
    """How long settled rollout ids are remembered to route late events to the .late topic."""

    orphan_bytes_per_client: int = Field(8 * 1024 * 1024, ge=256 * 1024)
    """Bytes of telemetry one client's rollouts without a RolloutRecord yet may hold, per
    partition (the client is the gateway's stamp of the sending key). Past it the client's
    oldest such rollout is evicted (counted as ``evicted``): a client flooding made-up
    rollout ids evicts only its own. An editor's open agent trajectories hold a few KB
    each; the default is ~120 events at the gateway's largest (68 KB)."""

    orphan_bytes: int = Field(64 * 1024 * 1024, ge=256 * 1024)
    """Bytes of telemetry all rollouts without a RolloutRecord yet may hold, per partition
    (>= orphan_bytes_per_client). Past it the oldest such rollout of any client is evicted."""

    event_time_max_future_s: float = Field(600.0, ge=0, le=24 * 3600)
    """A record whose event time (``client_ts_ms``) is more than this ahead of the joiner's
    wall clock is dead-lettered (.dlq, reason in the ``error`` header): it neither joins
    nor moves stream time, which would settle every honest rollout early with defaults.
    At least the gateway's and the serving API's allowance plus the hosts' clock skew."""

    event_time_max_age_s: float = Field(30 * 24 * 3600.0, gt=0)
    """A record whose event time is more than this behind the joiner's wall clock is
    dead-lettered. Longer than the gateway's allowance plus the longest backlog (topic
    retention) a joiner may have to catch up on."""

    web_port: int = Field(6066, ge=1, le=65535)
    """Port of faust's web server (worker status), bound to 127.0.0.1."""

    app_id: str = "rtrl-reward-stream"
    """faust application id; also the Kafka consumer group."""

    max_in_flight: int = Field(20_000, ge=1)
    """Output records handed to the producer but not yet acked by the broker before the
    agent waits; their input records stay unacknowledged until then."""

    trainer_mac_key: MacKey = SecretStr("")
    """The key (base64url, 32 bytes; rtrl/signing.py) of the MAC every reward carries for the
    trainer, which trains only on rewards that verify (RTRL_TRAINER_REWARD_MAC_KEYS). A MAC,
    not a signature: the trainer trusts the joiner's rewards whole, and a key it shares with
    the joiner alone lets it forge only to itself, for ~5 us a reward instead of Ed25519's
    ~40 us to sign and ~110 us to verify. No default: the joiner refuses to start without one
    (`rtrl up` generates it; `python -m rtrl.signing` prints one)."""

    analytics_mac_key: MacKey = SecretStr("")
    """The key of the MAC every reward and late record carries for the analytics sink
    (RTRL_ANALYTICS_REWARD_MAC_KEYS), which stores only what verifies, so the A/B report
    counts only the joiner's rewards. No default (`rtrl up` generates it)."""

    rollout_mac_keys: MacKeys = SecretStr("")
    """The key(s) of the MAC inference workers put on every rollout for the joiner
    (base64url, 32 bytes each; rtrl/signing.py), comma-separated (more than one while keys
    rotate): a rollout whose MAC does not verify is never joined: dead-lettered with the
    reason and counted as ``unauthenticated``. A MAC, not the workers' signature: the joiner
    re-emits every rollout it joins inside a reward it signs, so holding the key lets it
    forge nothing it could not already. No default: the joiner refuses to start without one
    (`rtrl up` generates it)."""

    event_keys: MacKeys = SecretStr("")
    """The ingest gateway's event key(s) (base64url, 32 bytes each; rtrl/signing.py),
    comma-separated (more than one while keys rotate): an event whose HMAC does not verify is
    never joined: dead-lettered with the reason and counted as ``unauthenticated``. No default:
    the joiner refuses to start without one (`rtrl up` generates it)."""

    reward_fn_version: str = "r3"
    """Reward function the live stream settles with (reward_stream/reward.py: r1, r2, r3, and
    a1, a1h, a2, a2h for an agent). Changing it changes every reward_id; recompute history with
    reward_stream.replay."""

    effort_curve: EffortCurve | None = None
    """The effort penalty's curve for the agentic rewards, as JSON (reward_stream/effort.py's
    fields, e.g. ``{"weight": 0.02, "turns": 1}``); unset: A1_EFFORT. A curve of its own makes a
    version of its own: rewards name it e.g. ``a2@<digest>`` (settled_version)."""

    def settled_version(self) -> str:
        """The version the joiner writes on every reward: reward_fn_version over effort_curve."""
        from rtrl.reward_stream.reward import with_curve

        return with_curve(self.reward_fn_version, self.effort_curve)

    @model_validator(mode="after")
    def _check(self) -> RewardStreamSettings:
        if self.grace_s > self.window_s:
            raise ValueError(f"grace_s ({self.grace_s}) must be <= window_s ({self.window_s})")
        self.join_config()  # the join's own checks (grace <= window, max_wait covers the window)
        from rtrl.reward_stream.reward import FUNCTIONS

        if self.reward_fn_version not in FUNCTIONS:
            raise ValueError(
                f"reward_fn_version {self.reward_fn_version!r} is not one of {sorted(FUNCTIONS)}"
            )
        from rtrl.reward_stream.reward import AGENTIC_SCALARS

        agentic = self.reward_fn_version.removesuffix("h") in AGENTIC_SCALARS
        if self.effort_curve is not None and not agentic:
            raise ValueError(
                "effort_curve shapes the agentic rewards (a1, a1h, a2, a2h) only, not "
                f"{self.reward_fn_version!r}"
            )
        return self

    def required_secrets(self, stack: StackSettings) -> list[RequiredSecret]:
        """What the joiner (``python -m rtrl.reward_stream``) and a replay do not start
        without (none of them is the stack's)."""
        return [
            RequiredSecret(
                self,
                "trainer_mac_key",
                "the joiner authenticates every reward to the trainer, and a replay as the "
                "joiner does (rtrl up generates it; python -m rtrl.signing prints one)",
            ),
            RequiredSecret(
                self,
                "analytics_mac_key",
                "the joiner authenticates every reward to the analytics sink "
                "(rtrl up generates it; python -m rtrl.signing prints one)",
            ),
            RequiredSecret(
                self,
                "rollout_mac_keys",
                "the joiner joins only rollouts an inference worker authenticated "
                "(rtrl up generates the key; python -m rtrl.signing prints one)",
            ),
            RequiredSecret(
                self,
                "event_keys",
                "the joiner joins only events the ingest gateway authenticated "
                "(rtrl up generates the key; python -m rtrl.signing prints one)",
            ),
        ]

    def reward_seal(self) -> signing.Seal:
        """What authenticates a reward: a MAC for each of its readers, the trainer and the
        analytics sink, each under a key the joiner shares with that reader alone."""
        return signing.Seal(
            signing.MacSigner(self.trainer_mac_key.get_secret_value(), signing.Purpose.REWARD),
            signing.MacSigner(self.analytics_mac_key.get_secret_value(), signing.Purpose.REWARD),
        )

    def late_seal(self) -> signing.MacSigner:
        """What authenticates a late record (read by the analytics sink alone): a purpose of
        its own, so a late record never passes for a reward."""
        return signing.MacSigner(
            self.analytics_mac_key.get_secret_value(), signing.Purpose.REWARD_LATE
        )

    def join_config(self) -> JoinConfig:
        return JoinConfig(
            window_ms=round(self.window_s * 1000),
            grace_ms=round(self.grace_s * 1000),
            deadline_slack_ms=round(self.deadline_slack_s * 1000),
            max_wait_ms=round(self.max_wait_s * 1000),
            settled_ttl_ms=round(self.settled_ttl_s * 1000),
            max_future_ms=round(self.event_time_max_future_s * 1000),
            max_age_ms=round(self.event_time_max_age_s * 1000),
            orphan_bytes_per_client=self.orphan_bytes_per_client,
            orphan_bytes=self.orphan_bytes,
        )
