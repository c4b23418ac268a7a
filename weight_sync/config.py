"""Settings of the weight_sync service (env prefix ``RTRL_WEIGHT_SYNC_``).

Connections (Redis, state_dir, the publish token) come from rtrl.config.StackSettings.
"""

from __future__ import annotations

import re
from urllib.parse import urlparse

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from rtrl.config import RequiredSecret, Settings, StackSettings, local_directory
from rtrl.grpc_limits import GRPCListener
from rtrl.tls import TLSListener

# S3's bucket naming rules, less the rarely used ones (no "..", no IP-address names).
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def split_s3_url(url: str) -> tuple[str, str]:
    """(bucket, prefix) of ``s3://bucket[/prefix]``; the prefix has no leading or
    trailing slash and may be empty. ValueError says what is wrong."""
    parsed = urlparse(url)
    if parsed.scheme != "s3":
        raise ValueError(f"{url!r} is not an s3:// URL")
    if not _BUCKET.fullmatch(parsed.netloc):
        raise ValueError(
            f"{url!r} needs a bucket name (3-63 of a-z, 0-9, '.', '-'): s3://bucket/prefix"
        )
    if parsed.params or parsed.query or parsed.fragment:
        raise ValueError(f"{url!r} has a query or fragment; use s3://bucket/prefix")
    prefix = parsed.path.strip("/")
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise ValueError(f"prefix of {url!r} has an empty, '.' or '..' segment")
    return parsed.netloc, prefix


class WeightSyncSettings(Settings, GRPCListener, TLSListener):
    model_config = SettingsConfigDict(env_prefix="RTRL_WEIGHT_SYNC_")

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

    max_blob_bytes: int = Field(8 << 30, ge=1 << 20)
    """Largest version a publisher may declare; a publish stream is refused the moment it carries
    more than its manifest declared (nothing past the declared size is ever buffered)."""

    blob_cache_bytes: int = Field(256 << 20, ge=0)
    """Verified blobs kept in memory, so every subscriber of a new version costs one
    read and one checksum between them rather than one each."""

    poll_interval_s: float = Field(0.5, gt=0, le=10)
    """A following subscriber re-reads the latest version this often, in case a pub/sub
    notification was missed."""

    heartbeat_interval_s: float = Field(1.0, gt=0, le=5)
    """Seconds between heartbeats (rtrl:hb:weight_sync:<instance>)."""

    shutdown_grace_s: float = Field(1.0, ge=0, le=60)
    """On SIGTERM, in-flight publishes get this long to finish; follow streams are then cut."""

    blob_url: str = ""
    """Where version blobs are stored: ``""`` for ``<state_dir>/blobs``,
    ``file:///absolute/path`` for another local directory, ``s3://bucket/prefix`` for
    S3 or an S3-compatible server (see s3_endpoint_url). Every server of one registry
    must use the same store."""

    s3_endpoint_url: str = ""
    """Endpoint of an S3-compatible server (``http://minio:9000``); ``""`` for AWS S3."""

    s3_region: str = ""
    """Region of the bucket; ``""`` lets boto3 find it (AWS_REGION, ~/.aws/config)."""

    s3_access_key_id: str = ""
    """Access key id; ``""`` together with an empty secret uses boto3's own credential
    chain (AWS_* variables, instance profile, web identity)."""

    s3_secret_access_key: SecretStr = SecretStr("")
    """Secret of s3_access_key_id."""

    keep_keyframes: int = Field(2, ge=1)
    """Garbage collection keeps the newest keep_keyframes keyframes of each arm and
    every version after the oldest of them; older blobs and manifests are deleted.
    Only the newest keyframe is ever on a subscriber's path; a second one covers a
    subscriber that planned its path just before a newer keyframe was committed."""

    gc_interval_s: float = Field(300.0, ge=0)
    """Seconds between garbage collections; 0 turns garbage collection off."""

    def required_secrets(self, stack: StackSettings) -> list[RequiredSecret]:
        """What ``python -m rtrl.weight_sync`` does not start without: both tokens it checks."""
        return [
            RequiredSecret(
                stack,
                "weight_sync_token",
                "publishers (the trainer) present it, and there is no default (rtrl up generates it)",
            ),
            RequiredSecret(
                stack,
                "weight_sync_subscribe_token",
                "workers and relays present it to follow versions, and there is no default "
                "(rtrl up generates it)",
            ),
        ]

    @model_validator(mode="after")
    def _check_blob_store(self) -> WeightSyncSettings:
        scheme = urlparse(self.blob_url).scheme
        if scheme == "s3":
            split_s3_url(self.blob_url)
        elif scheme == "file":
            try:
                local_directory(self.blob_url)
            except ValueError:
                raise ValueError(
                    f"blob_url {self.blob_url!r} must be file:///absolute/path (a local directory)"
                ) from None
        elif self.blob_url:
            raise ValueError(
                f"blob_url {self.blob_url!r} must be '' (<state_dir>/blobs), file:///absolute/path or s3://bucket/prefix"
            )
        s3_fields = [
            name
            for name in ("s3_endpoint_url", "s3_region", "s3_access_key_id")
            if getattr(self, name)
        ]
        if self.s3_secret_access_key.get_secret_value():
            s3_fields.append("s3_secret_access_key")
        if s3_fields and scheme != "s3":
            raise ValueError(
                f"{', '.join(s3_fields)} set, but blob_url {self.blob_url!r} is not an s3:// URL"
            )
        if bool(self.s3_access_key_id) != bool(self.s3_secret_access_key.get_secret_value()):
            raise ValueError(
                "s3_access_key_id and s3_secret_access_key go together: "
                "set both, or neither for boto3's credential chain"
            )
        endpoint = urlparse(self.s3_endpoint_url)
        if self.s3_endpoint_url and (
            endpoint.scheme not in ("http", "https") or not endpoint.hostname
        ):
            raise ValueError(
                f"s3_endpoint_url {self.s3_endpoint_url!r} must be http(s)://host[:port]"
            )
        return self
