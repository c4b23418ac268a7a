"""Settings every service shares: where the broker, Redis, ClickHouse and state live.

Services read only environment variables (through pydantic-settings), so the
embedded stack and a production cluster differ in configuration alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Annotated, Literal
from urllib.parse import unquote, urlparse

from pydantic import AfterValidator, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from rtrl import signing


class Settings(BaseSettings):
    """The base of every settings class: read from environment variables only (each
    subclass names its ``env_prefix``), variables it does not know ignored, and the
    docstring under each field kept as its description (``--help``, docs/configuration.md)."""

    model_config = SettingsConfigDict(extra="ignore", use_attribute_docstrings=True)


def env_name(cls: type[BaseSettings], field: str) -> str:
    """The environment variable ``field`` of ``cls`` is read from."""
    prefix = cls.model_config.get("env_prefix", "")
    return f"{prefix}{field}".upper()


# ---- secrets: their shape is checked wherever settings are built, their presence where a
# service starts (RequiredSecret), so in-process services and tests can build settings
# without the secrets they do not use.


def _check_token(token: str) -> None:
    if not (token.isascii() and token.isprintable()) or " " in token:
        raise ValueError(
            "not a bearer token: printable ASCII without spaces (it travels in an Authorization header)"
        )


def _secret(check: Callable[[str], object]) -> AfterValidator:
    """A secret's text checked by ``check`` (which raises ValueError) unless it is empty."""

    def validate(value: SecretStr) -> SecretStr:
        if value.get_secret_value():
            check(value.get_secret_value())
        return value

    return AfterValidator(validate)


def _mac_keys(value: SecretStr) -> SecretStr:
    # Normalised, so a list of nothing but commas reads as unset.
    return SecretStr(",".join(signing.parse_mac_keys(value.get_secret_value())))


def _public_keys(value: str) -> str:
    return ",".join(signing.parse_public_keys(value))


SigningKey = Annotated[SecretStr, _secret(signing.check_private_key)]
"""An Ed25519 private key, base64url (rtrl/signing.py; ``python -m rtrl.signing`` prints one)."""
MacKey = Annotated[SecretStr, _secret(signing.check_mac_key)]
"""One event key: 32 bytes, base64url."""
MacKeys = Annotated[SecretStr, AfterValidator(_mac_keys)]
"""Event keys, comma-separated (more than one while keys rotate)."""
PublicKeys = Annotated[str, AfterValidator(_public_keys)]
"""Ed25519 public keys, base64url, comma-separated (more than one while keys rotate). Not secret."""
BearerToken = Annotated[SecretStr, _secret(_check_token)]
"""A bearer token: printable ASCII without spaces."""


@dataclass(frozen=True)
class RequiredSecret:
    """A secret, or the public keys that verify what a service reads, without which the
    service does not start: ``python -m SERVICE`` refuses it unset, naming its variable and
    saying why (rtrl/entrypoint.py parse_settings). A malformed one is refused by its
    field's type wherever the settings are built."""

    settings: BaseSettings
    """The parsed settings that hold it: the service's own, or StackSettings."""
    field: str
    why: str
    """What the service does with it, and where it comes from."""

    @property
    def variable(self) -> str:
        return env_name(type(self.settings), self.field)

    def is_set(self) -> bool:
        value: str | SecretStr = getattr(self.settings, self.field)
        text = value.get_secret_value() if isinstance(value, SecretStr) else value
        return bool(text.strip())


def local_directory(url: str) -> Path:
    """The directory a ``file:///absolute/path`` URL names; ValueError for any other URL
    (another host, a relative path, a query or fragment)."""
    parsed = urlparse(url)
    path = PurePosixPath(unquote(parsed.path))
    if (
        parsed.scheme != "file"
        or parsed.netloc not in ("", "localhost")
        or not path.is_absolute()
        or parsed.params
        or parsed.query
        or parsed.fragment
    ):
        raise ValueError(f"{url!r} is not file:///absolute/path")
    return Path(path)


class StackSettings(Settings):
    """Connection settings shared by all services (env prefix ``RTRL_``)."""

    model_config = SettingsConfigDict(env_prefix="RTRL_")

    kafka_bootstrap: str = "127.0.0.1:9092"
    """Kafka bootstrap servers, comma separated."""

    kafka_partitions: int = Field(4, ge=1, le=256)
    """Partition count of every telemetry and reward topic (they must be equal)."""

    kafka_replication_factor: int = Field(1, ge=1)
    """Replication factor of the topics rtrl creates (Tansu: 1; a Kafka cluster whose
    ``min.insync.replicas`` is 2 needs at least 3, or every ``acks=all`` produce fails)."""

    kafka_max_record_bytes: int = Field(1_000_000, ge=64 * 1024, le=256 * 1024 * 1024)
    """Largest record a service writes (librdkafka's ``message.max.bytes``). The broker's and
    the topics' limits must be at least this (Apache Kafka's default is about 1 MB). A rollout
    record that would leave its reward (which carries it) over it, e.g. a long mixture-of-experts
    rollout with its routes, is served but not recorded, and the answer says why."""

    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """How every Kafka client connects: PLAINTEXT for the embedded broker (Tansu has no
    authentication; it listens on loopback only), SASL_SSL for a production cluster."""

    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = "SCRAM-SHA-512"
    """SASL mechanism when the protocol is SASL_*."""

    kafka_sasl_username: str = ""
    """This process's Kafka user (one per service, so the cluster's ACLs can hold each to its topics)."""

    kafka_sasl_password: SecretStr = SecretStr("")
    """This process's Kafka password."""

    kafka_ssl_ca_file: str = ""
    """CA certificate that signed the brokers' certificates, for SSL and SASL_SSL (empty: the system's)."""

    kafka_session_timeout_ms: int = Field(6000, ge=1000)
    """Consumer-group session timeout. Tansu forms groups in ~3 s at 6 s, ~23 s at 45 s."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis: version registry, dedup keys, heartbeats."""

    clickhouse_url: str = ""
    """``chdb:///path`` for embedded ClickHouse, ``http://host:8123`` for a server.
    Empty means ``chdb://<state_dir>/chdb``."""

    weight_sync_addr: str = "127.0.0.1:50061"
    """gRPC address of the weight_sync service."""

    weight_sync_tls_ca_file: Path | None = None
    """CA certificate that signed weight_sync's (and its relays') certificate: set it when they
    listen with TLS (RTRL_WEIGHT_SYNC_TLS_CERT_FILE), and every client connects with TLS."""

    weight_sync_token: BearerToken = SecretStr("")
    """Bearer token that allows publishing weights (the trainer, and weight_sync to check it).
    No default: both refuse to start without one (`rtrl up` generates its own)."""

    weight_sync_subscribe_token: BearerToken = SecretStr("")
    """Bearer token that allows following versions (inference workers, relays, SGLang
    sidecars); it cannot publish. No default, as for the publish token."""

    manifest_public_keys: PublicKeys = ""
    """The trainer's Ed25519 public key(s) for weight manifests, comma-separated (more than
    one while keys rotate; weight_sync/provenance.py): a worker applies only versions
    whose manifest verifies against one. Not secret. No default: workers refuse to
    start without one (`rtrl up` derives it from the trainer's key)."""

    api_key_public_keys: PublicKeys = ""
    """The operator's Ed25519 public key(s) for API key records, comma-separated (rtrl/api_keys.py):
    the ingest gateway and the serving API accept only keys whose record in Redis verifies
    against one. Not secret. No default: they refuse to start without one when they
    require keys (`rtrl up` derives it)."""

    model_dir: Path | None = None
    """The policy: a Hugging Face model directory (config.json, safetensors, tokenizer.json,
    a chat template for /v1/chat/completions) that every worker serves and the trainer
    trains (``rtrl up --model DIR``). Unset: the built-in demo policy, warm-started."""

    state_dir: Path = Path(".rtrl")
    """Where the embedded stack keeps blobs, checkpoints, chdb data and logs."""

    rollout_bulk_url: str = ""
    """Where rollout records too large to travel inline keep their bulk (rtrl/bulk.py):
    ``""`` for ``<state_dir>/rollout-bulk``, or ``file:///absolute/path`` (a directory every
    inference worker writes and every trainer reads: a shared volume on a cluster)."""

    instance: str = "0"
    """Instance name of this process (several workers of one service differ here)."""

    otel_exporter: Literal["file", "otlp", "none"] = "file"
    """Where OpenTelemetry spans and metrics go: ``file`` writes JSON lines under
    ``<state_dir>/otel/`` (readable on the embedded stack); ``otlp`` sends them over
    OTLP/gRPC to ``otlp_endpoint`` (a collector, in production); ``none`` drops them."""

    otel_file_max_bytes: int = Field(64 * 1024 * 1024, ge=64 * 1024)
    """The largest a span or metric file (``otel_exporter=file``) grows before it becomes
    ``<name>.1`` (replacing the previous one) and a new one starts: a service's spans and
    metrics take at most four times this on disk (rtrl/rotation.py)."""

    log_max_bytes: int = Field(64 * 1024 * 1024, ge=64 * 1024)
    """The largest a process's log under ``<state_dir>/logs/`` grows before the supervisor
    copies it to ``<name>.1`` and truncates it (checked every few seconds, so a log may pass
    it by what is written meanwhile): each log takes about twice this on disk at most."""

    otlp_endpoint: str = "http://127.0.0.1:4317"
    """OTLP/gRPC endpoint of the OpenTelemetry collector (``otel_exporter=otlp``)."""

    otel_trace_sample_ratio: float = Field(1.0, ge=0, le=1)
    """Share of traces recorded. The root decides (a rollout's serving span, a training
    step) and every span in its trace follows, in every service."""

    otel_metric_interval_s: float = Field(10.0, gt=0)
    """How often OpenTelemetry metrics are exported (the Prometheus endpoint is read
    at scrape time instead)."""

    metrics_port: int = Field(0, ge=0, le=65535)
    """Port of this process's Prometheus ``/metrics`` endpoint; 0 serves none. The
    embedded stack gives every process a free one (``rtrl status`` lists them)."""

    metrics_bind_host: str = "127.0.0.1"
    """Address the Prometheus endpoint listens on (``0.0.0.0`` in a container)."""

    metrics_tls_cert_file: Path | None = None
    """PEM certificate chain: when set (with metrics_tls_key_file), the Prometheus endpoint
    speaks TLS only (scrape it with ``scheme: https``)."""

    metrics_tls_key_file: Path | None = None
    """PEM private key of metrics_tls_cert_file."""

    metrics_client_timeout_s: float = Field(10.0, gt=0, le=600)
    """The Prometheus endpoint closes a connection whose TLS handshake or request headers
    are not complete this long after it opened, or that stays idle this long after an answer
    (rtrl/http_limits.py; a scrape is one small GET)."""

    @model_validator(mode="after")
    def _metrics_tls_pair(self) -> StackSettings:
        if (self.metrics_tls_cert_file is None) != (self.metrics_tls_key_file is None):
            raise ValueError("set both metrics_tls_cert_file and metrics_tls_key_file, or neither")
        return self

    @model_validator(mode="after")
    def _sasl_has_credentials(self) -> StackSettings:
        if self.kafka_security_protocol.startswith("SASL_") and not (
            self.kafka_sasl_username and self.kafka_sasl_password.get_secret_value()
        ):
            raise ValueError(
                f"kafka_security_protocol {self.kafka_security_protocol} "
                "needs kafka_sasl_username and kafka_sasl_password"
            )
        return self

    @model_validator(mode="after")
    def _rollout_bulk_is_a_directory(self) -> StackSettings:
        if self.rollout_bulk_url:
            try:
                local_directory(self.rollout_bulk_url)
            except ValueError:
                raise ValueError(
                    f"rollout_bulk_url {self.rollout_bulk_url!r} must be '' "
                    "(<state_dir>/rollout-bulk) or file:///absolute/path"
                ) from None
        return self

    def resolved_rollout_bulk_dir(self) -> Path:
        if not self.rollout_bulk_url:
            return self.state_dir / "rollout-bulk"
        return local_directory(self.rollout_bulk_url)

    def resolved_clickhouse_url(self) -> str:
        return self.clickhouse_url or f"chdb://{(self.state_dir / 'chdb').resolve()}"
