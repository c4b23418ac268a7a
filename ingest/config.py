"""Settings of the ingest gateway (env prefix ``RTRL_INGEST_``)."""

from __future__ import annotations

import urllib.parse

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from rtrl.config import MacKey, RequiredSecret, Settings, StackSettings
from rtrl.event_time import EventTimeWindow
from rtrl.grpc_limits import GRPCAgedListener
from rtrl.http_limits import HTTPListener
from rtrl.tls import TLSListener


class IngestSettings(Settings, HTTPListener, GRPCAgedListener, TLSListener):
    model_config = SettingsConfigDict(env_prefix="RTRL_INGEST_")

    bind_host: str = "127.0.0.1"
    """Address both listeners bind to (``0.0.0.0`` in a container)."""

    http_port: int = Field(8081, ge=1, le=65535)
    """Port of the HTTP API (``POST /v1/events``, ``GET /healthz``)."""

    grpc_port: int = Field(50051, ge=1, le=65535)
    """Port of the gRPC ``rtrl.v1.Ingest`` service."""

    dedup_ttl_s: int = Field(24 * 3600, ge=60)
    """How long an accepted event_id is remembered; a resend within it is a DUPLICATE."""

    claim_ttl_s: int = Field(30, ge=1)
    """How long an event_id stays claimed while its produce is in flight. A gateway that
    dies mid-produce frees its claims after this, so the client's retry goes through."""

    produce_timeout_ms: int = Field(10_000, ge=100)
    """librdkafka ``message.timeout.ms``: a produce not acked by then fails and the event is RETRY."""

    max_inflight: int = Field(10_000, ge=1)
    """Events awaiting a broker ack, across all requests; beyond it events get RETRY (HTTP 429)."""

    max_batch: int = Field(1_000, ge=1)
    """Most events one request may carry; larger requests are refused whole."""

    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    """Largest HTTP body (decompressed) / gRPC message accepted: max_batch events of up to 16 KB."""

    max_inflation: int = Field(20, ge=1)
    """A compressed HTTP body may expand to at most this many times its Content-Length (telemetry
    JSON compresses 5-10x); past it the request is refused with 413, read no further."""

    retry_after_s: int = Field(1, ge=0)
    """The ``Retry-After`` header sent with a 429."""

    event_key: MacKey = SecretStr("")
    """The key (base64url, 32 bytes; rtrl/signing.py) the gateway authenticates every event it
    writes with (an HMAC-SHA256 in the record's headers): the joiner holds it too and joins
    only events that verify, so nothing that merely reaches the broker can steer rewards.
    No default: the gateway refuses to start without one (`rtrl up` generates it)."""

    analytics_event_key: MacKey = SecretStr("")
    """The key of the second MAC every event carries, for the analytics sink alone
    (RTRL_ANALYTICS_EVENT_KEYS), which stores only events that verify, so nothing written
    around the gateway reaches the A/B report. A key of its own: the sink cannot forge an
    event the joiner takes. No default (`rtrl up` generates it)."""

    auth_required: bool = True
    """Refuse requests without a valid API key (rtrl/api_keys.py). Off only for local experiments."""

    key_bytes_per_event: int = Field(8 * 1024, ge=0, le=1024 * 1024)
    """Event bytes a key may send per event of its rate: its events per second and burst
    (signed in its record) times this are its bytes per second and burst, spent from a
    bucket of their own (429 naming the byte budget when spent). With the default
    budgets, 160 KiB/s in bursts of 480 KiB: an editor's events are a few KB, and a key
    sending 68 KB edits (the largest the gateway takes) writes 2.4 a second, not 20.
    0: no byte budget; a key without a rate has none either."""

    key_cache_ttl_s: float = Field(1.0, gt=0, le=300)
    """How long a gateway trusts a key record it read from Redis: a revocation takes effect within this."""

    client_ts_max_future_s: float = Field(300.0, ge=0, le=24 * 3600)
    """An event's ``client_ts_ms`` may be at most this far ahead of the gateway's clock
    (client clock skew); a later one is REJECTED (field ``client_ts_ms``)."""

    client_ts_max_age_s: float = Field(7 * 24 * 3600.0, gt=0, le=365 * 24 * 3600)
    """An event's ``client_ts_ms`` may be at most this far behind the gateway's clock; an
    older one (or 0, or negative) is REJECTED (field ``client_ts_ms``)."""

    cors_origins: list[str] = []
    """Web origins (``https://app.example.com``: scheme, host, port) whose pages may send
    events from a browser, with the TypeScript SDK's browser build: the gateway answers their
    preflight and lets them read its answers. Exact origins only, no wildcard; a JSON list
    (``RTRL_INGEST_CORS_ORIGINS='["https://app.example.com"]'``). Empty (the default): no
    preflight is answered, and browsers refuse every cross-origin send. A key shipped to a
    browser is public: scope it to the events the page sends and give it a rate."""

    @field_validator("cors_origins")
    @classmethod
    def _exact_origins(cls, origins: list[str]) -> list[str]:
        return [web_origin(origin) for origin in origins]

    def client_ts_window(self) -> EventTimeWindow:
        return EventTimeWindow.of_seconds(self.client_ts_max_future_s, self.client_ts_max_age_s)

    def required_secrets(self, stack: StackSettings) -> list[RequiredSecret]:
        """What ``python -m rtrl.ingest`` does not start without."""
        required = [
            RequiredSecret(
                self,
                "event_key",
                "the gateway authenticates every event it writes "
                "(rtrl up generates it; python -m rtrl.signing prints one)",
            ),
            RequiredSecret(
                self,
                "analytics_event_key",
                "the gateway authenticates every event to the analytics sink too "
                "(rtrl up generates it; python -m rtrl.signing prints one)",
            ),
        ]
        if self.auth_required:
            required.append(
                RequiredSecret(
                    stack,
                    "api_key_public_keys",
                    "the gateway accepts only API keys the operator signed (rtrl up derives it)",
                )
            )
        return required

    @model_validator(mode="after")
    def _claim_outlives_produce(self) -> IngestSettings:
        # A claim that expired while its produce is still in flight would let a resend
        # produce the same event a second time.
        if self.claim_ttl_s * 1000 <= self.produce_timeout_ms:
            raise ValueError(
                f"claim_ttl_s ({self.claim_ttl_s} s) must exceed produce_timeout_ms ({self.produce_timeout_ms} ms)"
            )
        if self.http_port == self.grpc_port:
            raise ValueError(f"http_port and grpc_port must differ, both are {self.http_port}")
        return self


DEFAULT_PORTS = {"http": 80, "https": 443}


def web_origin(text: str) -> str:
    """``text`` as the exact Origin a browser sends (lowercase scheme and host, no default
    port), or ValueError when it is not one origin: a path, a query, credentials, a wildcard
    or another scheme than http(s)."""
    parts = urllib.parse.urlsplit(text.strip())
    if (
        parts.scheme not in DEFAULT_PORTS
        or not parts.hostname
        or parts.username is not None
        or parts.password is not None
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
        or "*" in parts.netloc
    ):
        raise ValueError(
            f"{text!r} is not a web origin: give scheme://host[:port], e.g. https://app.example.com"
        )
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{text!r} is not a web origin: {exc}") from None
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    if port is None or port == DEFAULT_PORTS[parts.scheme]:
        return f"{parts.scheme}://{host}"
    return f"{parts.scheme}://{host}:{port}"
