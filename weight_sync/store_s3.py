"""Blobs in S3 or an S3-compatible server: ``s3://bucket/prefix/<arm>/<version>.blob``.

An object appears whole or not at all: a small blob is one PutObject, a large one
a multipart upload that is visible only once completed (and aborted on failure),
so a reader never sees half a blob. Versions are never overwritten, except by two
servers racing for one version, and then the manifest's checksum catches the loser.

The credentials need s3:GetObject, s3:PutObject, s3:DeleteObject and s3:ListBucket
on the bucket: without ListBucket, S3 answers a missing key with 403 instead of 404,
and a missing blob would look like a denied one instead of taking the repair path.
"""

from __future__ import annotations

import io
from urllib.parse import urlparse

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from rtrl.weight_sync.config import WeightSyncSettings, split_s3_url
from rtrl.weight_sync.store import (
    MAX_MANIFEST_BYTES,
    ArmFiles,
    BlobSizeMismatch,
    BlobStore,
    add_listed,
    arm_files,
    blob_name,
    check_size,
    manifest_name,
    parse_blob_name,
)

# HeadObject answers a missing key with a bare 404; GetObject says NoSuchKey.
_MISSING = {"404", "NoSuchKey", "NotFound"}


class S3BlobStore(BlobStore):
    # Connection failures, and error answers (throttling, 5xx) left after boto3's retries.
    unavailable = (BotoCoreError, ClientError)

    def __init__(self, client, bucket: str, prefix: str) -> None:
        """client: a boto3 S3 client (thread-safe; the servicer calls from threads)."""
        self._client = client
        self.bucket = bucket
        self.prefix = prefix
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"

    @classmethod
    def from_settings(cls, settings: WeightSyncSettings) -> S3BlobStore:
        bucket, prefix = split_s3_url(settings.blob_url)
        config = Config(
            retries={"mode": "standard"},
            # S3-compatible servers (Ceph, older MinIO) reject the CRC checksum trailers
            # that boto3 sends by default; the manifest's xxh3 checks every blob end to end.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            # MinIO and most S3-compatible servers serve path-style URLs out of the box,
            # bucket subdomains only when configured for them.
            s3={"addressing_style": "path"} if settings.s3_endpoint_url else None,
        )
        client = boto3.session.Session().client(
            "s3",
            endpoint_url=settings.s3_endpoint_url or None,
            region_name=settings.s3_region or None,
            aws_access_key_id=settings.s3_access_key_id or None,
            aws_secret_access_key=settings.s3_secret_access_key.get_secret_value() or None,
            config=config,
        )
        return cls(client, bucket, prefix)

    def key(self, arm: str, version: int) -> str:
        return self._key(blob_name(arm, version))

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def write(self, arm: str, version: int, blob: bytes) -> str:
        key = self.key(arm, version)
        # upload_fileobj switches to a (parallel) multipart upload above 8 MiB, so
        # snapshots beyond PutObject's 5 GB limit still go through.
        self._client.upload_fileobj(io.BytesIO(blob), self.bucket, key)
        return f"s3://{self.bucket}/{key}"

    def write_manifest(self, arm: str, version: int, manifest: bytes) -> None:
        self._client.put_object(
            Bucket=self.bucket, Key=self._key(manifest_name(arm, version)), Body=manifest
        )

    def read_manifest(self, arm: str, version: int) -> bytes:
        key = self._key(manifest_name(arm, version))
        uri = f"s3://{self.bucket}/{key}"
        try:
            answer = self._client.get_object(
                Bucket=self.bucket, Key=key, Range=f"bytes=0-{MAX_MANIFEST_BYTES}"
            )
        except ClientError as exc:
            _raise_if_missing(exc, uri)
            raise
        manifest: bytes = answer["Body"].read(MAX_MANIFEST_BYTES + 1)
        if len(manifest) > MAX_MANIFEST_BYTES:
            raise BlobSizeMismatch(f"{uri} is over the {MAX_MANIFEST_BYTES:,} bytes read")
        return manifest

    def listing(self) -> dict[str, ArmFiles]:
        found: dict[str, dict[str, set[int]]] = {}
        start = f"{self.prefix}/" if self.prefix else ""
        for page in self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=start
        ):
            for item in page.get("Contents", []):
                add_listed(found, item["Key"].removeprefix(start))
        return arm_files(found)

    def read(self, blob_uri: str, size: int) -> bytes:
        key = self._key_of(blob_uri)
        try:
            head = self._client.head_object(Bucket=self.bucket, Key=key)
            check_size(blob_uri, head["ContentLength"], size)
            out = io.BytesIO()
            # The transfer reads the size it is told by a HEAD of its own, in ranges.
            self._client.download_fileobj(self.bucket, key, out)
        except ClientError as exc:
            _raise_if_missing(exc, blob_uri)
            raise
        check_size(blob_uri, out.getbuffer().nbytes, size)
        return out.getvalue()

    def exists(self, blob_uri: str) -> bool:
        try:
            self._client.head_object(Bucket=self.bucket, Key=self._key_of(blob_uri))
        except ClientError as exc:
            if exc.response["Error"]["Code"] in _MISSING:
                return False
            raise
        return True

    def delete(self, blob_uri: str) -> None:
        # DeleteObject succeeds for a key that is already gone.
        key = self._key_of(blob_uri)
        self._client.delete_object(Bucket=self.bucket, Key=key.removesuffix(".blob") + ".manifest")
        self._client.delete_object(Bucket=self.bucket, Key=key)

    def owns(self, blob_uri: str) -> bool:
        try:
            self._key_of(blob_uri)
        except ValueError:
            return False
        return True

    def _key_of(self, blob_uri: str) -> str:
        parsed = urlparse(blob_uri)
        if parsed.scheme != "s3" or parsed.netloc != self.bucket:
            raise ValueError(f"blob URI {blob_uri!r} is not in the store at {self.url}")
        key = parsed.path.removeprefix("/")
        name = key.removeprefix(f"{self.prefix}/") if self.prefix else key
        if name == key and self.prefix:
            raise ValueError(f"blob URI {blob_uri!r} points outside the store at {self.url}")
        parse_blob_name(name, blob_uri)
        return key


def _raise_if_missing(exc: ClientError, uri: str) -> None:
    if exc.response["Error"]["Code"] in _MISSING:
        raise FileNotFoundError(f"{uri} is gone") from exc
