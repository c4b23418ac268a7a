"""Settings of the analytics sink (env prefix ``RTRL_ANALYTICS_``)."""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from rtrl.config import (
    BearerToken,
    MacKeys,
    PublicKeys,
    RequiredSecret,
    Settings,
    StackSettings,
)
from rtrl.http_limits import HTTPListener
from rtrl.tls import TLSListener


class AnalyticsSettings(Settings, HTTPListener, TLSListener):
    model_config = SettingsConfigDict(env_prefix="RTRL_ANALYTICS_")

    bind_host: str = "127.0.0.1"
    """Address the query endpoint binds to."""

    query_port: int = Field(8124, ge=1, le=65535)
    """Port of the read-only ``POST /query`` endpoint (chdb lives in this process only)."""

    batch_size: int = Field(5_000, ge=1)
    """Rows buffered (over all tables) before an insert is forced."""

    flush_interval_s: float = Field(1.0, gt=0, le=60)
    """Longest a consumed record waits in the buffer before it is inserted."""

    group_id: str = Field("analytics", min_length=1)
    """Consumer group; offsets are committed only after the rows are inserted."""

    query_timeout_s: float = Field(30.0, gt=0)
    """Budget of one ``/query`` request (also the ClickHouse ``max_execution_time``)."""

    query_token: BearerToken = SecretStr("")
    """The operator's credential for ``POST /query`` (``Authorization: Bearer``). There is no
    default: without one the sink serves no queries (`rtrl up` generates one per state
    directory; `rtrl report` and `rtrl status` read it from there)."""

    query_clickhouse_url: SecretStr = SecretStr("")
    """Where ``/query`` runs: a ClickHouse user granted SELECT on the project's tables and
    nothing else (no table functions, no other database; compose/clickhouse-users.xml), on
    top of the guard's allow-list. Empty: the sink's own connection, read-only (chdb has
    no users). Secret: the URL carries that user's password."""

    query_max_rows: int = Field(100_000, ge=1)
    """Most rows one ``/query`` answer may hold; a query past it is refused, not truncated."""

    query_max_bytes: int = Field(64 << 20, ge=1024)
    """Most bytes one ``/query`` result may hold in ClickHouse; past it the query is refused."""

    shutdown_drain_s: float = Field(5.0, ge=0, le=300)
    """On SIGTERM, how long the sink keeps reading while records still arrive (it stops
    at the first empty poll): the embedded stack stops it after every producer, so what
    they wrote last reaches ClickHouse before a memory-only broker goes away."""

    rollout_public_keys: PublicKeys = ""
    """The inference workers' Ed25519 public key(s) for rollout records, comma-separated (more
    than one while keys rotate; analytics/authn.py): a rollout whose signature does not verify
    is not stored (``dead_letters`` holds it, with the reason). No default: the sink refuses
    to start without one (`rtrl up` derives it)."""

    reward_mac_keys: MacKeys = SecretStr("")
    """The key(s) the joiner authenticates rewards and late records to the sink with (base64url,
    32 bytes each, comma-separated while keys rotate; the joiner's
    RTRL_REWARD_ANALYTICS_MAC_KEY), never the trainer's: a reward whose MAC does not verify is
    not stored, so it is in no A/B number. No default (`rtrl up` generates it)."""

    event_keys: MacKeys = SecretStr("")
    """The key(s) the ingest gateway authenticates telemetry events to the sink with (base64url,
    32 bytes each, comma-separated while keys rotate; the gateway's
    RTRL_INGEST_ANALYTICS_EVENT_KEY), never the joiner's: an event whose MAC does not verify
    is not stored. No default: the sink refuses to start without one (`rtrl up` generates it)."""

    def required_secrets(self, stack: StackSettings) -> list[RequiredSecret]:
        """What the sink (``python -m rtrl.analytics``) does not start without: the keys it
        verifies every record it stores with (analytics/authn.py)."""
        return [
            RequiredSecret(
                self,
                "rollout_public_keys",
                "the sink stores only rollouts an inference worker signed (rtrl up derives it)",
            ),
            RequiredSecret(
                self,
                "reward_mac_keys",
                "the sink stores only rewards and late records the joiner authenticated to it "
                "(rtrl up generates the key; python -m rtrl.signing prints one)",
            ),
            RequiredSecret(
                self,
                "event_keys",
                "the sink stores only events the ingest gateway authenticated to it "
                "(rtrl up generates the key; python -m rtrl.signing prints one)",
            ),
            RequiredSecret(
                stack,
                "manifest_public_keys",
                "the sink stores only trainer steps the trainer signed (rtrl up derives it)",
            ),
        ]
