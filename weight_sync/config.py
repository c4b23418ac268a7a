"""Settings of the weight_sync service (env prefix ``RTRL_WEIGHT_SYNC_``).

Connections (Redis, state_dir, the publish token) come from rtrl.config.StackSettings.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class WeightSyncSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RTRL_WEIGHT_SYNC_", extra="ignore")

    bind_host: str = "127.0.0.1"
    """Address the gRPC server binds to (``0.0.0.0`` in a container)."""

    port: int = Field(50061, ge=0, le=65535)
    """gRPC port; 0 picks a free one (tests)."""

    chunk_bytes: int = Field(1 << 20, ge=4096, le=3 << 20)
    """Blob bytes per streamed WeightChunk; stays under gRPC's 4 MiB default message limit."""

    keyframe_every: int = Field(20, ge=1)
    """Longest delta chain: version v must be a keyframe if the newest keyframe is at or
    below v - keyframe_every. Publishers use the same cadence (keyframe when
    v % keyframe_every == 0); a delta that would break it is refused with
    FAILED_PRECONDITION and the publisher resends a keyframe. Bounds what a new
    subscriber must download."""

    poll_interval_s: float = Field(0.5, gt=0, le=10)
    """A following subscriber re-reads the latest version this often, in case a pub/sub
    notification was missed."""

    heartbeat_interval_s: float = Field(1.0, gt=0, le=5)
    """Seconds between heartbeats (rtrl:hb:weight_sync:<instance>)."""

    shutdown_grace_s: float = Field(1.0, ge=0, le=60)
    """On SIGTERM, in-flight publishes get this long to finish; follow streams are then cut."""
