"""The blob stores: one contract run on a local directory and on S3, the blob_url
settings, and weight_sync end to end with its blobs in S3.

S3 is moto's standalone server on a free loopback port, spoken to over HTTP by the
same boto3 client production uses; each test gets its own bucket.
"""

from __future__ import annotations

import asyncio
import functools
import os
import tracemalloc
import uuid
from typing import TypedDict

import boto3
import pytest
from moto.server import ThreadedMotoServer

from rtrl import procs
from rtrl.config import StackSettings
from rtrl.v1 import weights_pb2
from rtrl.weight_sync.client import Publisher, Subscriber
from rtrl.weight_sync.config import WeightSyncSettings
from rtrl.weight_sync.servicer import RegistrySource
from rtrl.weight_sync.store import ArmFiles, LocalBlobStore, open_store
from rtrl.weight_sync.store_s3 import S3BlobStore

# The in-process server and subscriber helpers of the local-store tests.
from support.weight_sync import (
    MANIFEST_KEY,
    MANIFEST_PUBLIC_KEYS,
    SUBSCRIBE_TOKEN,
    Following,
    InProcessServer,
    assert_bit_identical,
    publish_versions,
)


class S3Login(TypedDict):
    s3_region: str
    s3_access_key_id: str
    s3_secret_access_key: str


# Fake credentials and region for moto; also keeps boto3 from reading ~/.aws.
S3_LOGIN: S3Login = {
    "s3_region": "us-east-1",
    "s3_access_key_id": "testing",
    "s3_secret_access_key": "testing",
}


@pytest.fixture(scope="session")
def s3_endpoint():
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint) -> str:
    bucket = f"rtrl-{uuid.uuid4().hex[:12]}"
    client = boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    client.create_bucket(Bucket=bucket)
    return bucket


def s3_keys(endpoint: str, bucket: str) -> list[str]:
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    return sorted(item["Key"] for item in client.list_objects_v2(Bucket=bucket).get("Contents", []))


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return open_store(WeightSyncSettings(), StackSettings(state_dir=tmp_path / "state"))
    endpoint, bucket = request.getfixturevalue("s3_endpoint"), request.getfixturevalue("s3_bucket")
    return open_store(
        WeightSyncSettings(blob_url=f"s3://{bucket}/weights", s3_endpoint_url=endpoint, **S3_LOGIN),
        StackSettings(),
    )


@pytest.mark.parametrize("size", [0, 1000, 9 << 20], ids=["empty", "small", "multipart"])
def test_written_blob_reads_back(store, size):
    blob = os.urandom(size)
    uri = store.write("treatment", 3, blob)
    if isinstance(store, S3BlobStore):
        assert uri == f"s3://{store.bucket}/weights/treatment/3.blob"
    else:
        assert uri == (store.root / "treatment" / "3.blob").as_uri()
    assert store.owns(uri) and store.exists(uri)
    assert store.read(uri, len(blob)) == blob
    store.write("treatment", 3, b"again")
    assert store.read(uri, 5) == b"again"


@pytest.mark.guarantee(7)
def test_l8_a_blob_of_another_size_than_its_manifest_says_is_refused_before_it_is_read(store):
    """L8: a blob in the store larger than its manifest's blob_size (a bad or planted
    file) was read whole before its size was checked (+1.8 GB for a large one); now the
    store's size (stat, HEAD) is checked first and nothing of it is read."""
    uri = store.write("treatment", 3, os.urandom(8 << 20))
    manifest = weights_pb2.Manifest(arm="treatment", version=3, blob_uri=uri, blob_size=100)
    source = RegistrySource(registry=None, store=store, head_max_age_s=1.0)  # type: ignore[arg-type]
    gets: list[str] = []
    if isinstance(store, S3BlobStore):  # moto serves in this process: count the GETs instead
        store._client.meta.events.register(
            "before-call.s3.GetObject", lambda **kwargs: gets.append("GET")
        )
    tracemalloc.start()
    try:
        blob = asyncio.run(source.blob(manifest))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert blob is None and gets == []
    if not isinstance(store, S3BlobStore):
        assert peak < 2 << 20, f"{peak:,} bytes allocated to refuse an 8 MiB blob"


def test_deleted_blob_is_missing(store):
    uri = store.write("control", 0, b"warm start")
    kept = store.write("control", 1, b"next")
    store.delete(uri)
    assert not store.exists(uri) and store.owns(uri)
    with pytest.raises(FileNotFoundError):
        store.read(uri, 10)
    store.delete(uri)  # already gone: no error
    assert store.read(kept, 4) == b"next"


def test_manifests_lie_beside_their_blobs_and_are_listed_and_deleted_with_them(store):
    uris = {
        version: store.write("treatment", version, b"blob %d" % version) for version in (0, 1, 2)
    }
    store.write_manifest("treatment", 0, b"manifest 0")
    store.write_manifest("treatment", 1, b"manifest 1")
    store.write_manifest("control", 5, b"a manifest whose blob never came")
    assert store.read_manifest("treatment", 1) == b"manifest 1"
    with pytest.raises(FileNotFoundError):
        store.read_manifest("treatment", 2)
    assert store.listing() == {
        "control": ArmFiles(manifests=frozenset({5})),
        "treatment": ArmFiles(manifests=frozenset({0, 1}), blobs=frozenset({0, 1, 2})),
    }
    store.delete(uris[0])
    with pytest.raises(FileNotFoundError):
        store.read_manifest("treatment", 0)
    assert store.listing()["treatment"] == ArmFiles(
        manifests=frozenset({1}), blobs=frozenset({1, 2})
    )


def test_never_written_blob_is_missing(store):
    uri = store.write("treatment", 0, b"x").replace("/0.blob", "/7.blob")
    assert store.owns(uri) and not store.exists(uri)
    with pytest.raises(FileNotFoundError):
        store.read(uri, 1)


@pytest.mark.parametrize("arm", ["", "../etc", "a/b", ".hidden", "x" * 65, "tab\tarm"])
def test_bad_arm_names_are_refused(store, arm):
    with pytest.raises(ValueError, match="not a valid arm name"):
        store.write(arm, 0, b"blob")


def test_uris_outside_the_store_are_refused(store):
    uri = store.write("treatment", 2, b"blob")
    root, _, name = uri.rpartition("/treatment/")
    foreign = [
        f"{root}/../elsewhere/treatment/{name}",  # climbs out of the store
        f"{root}/treatment/../../elsewhere/2.blob",
        f"{root}/treatment/2.txt",  # inside, but not a blob name
        f"{root}/treatment/sub/2.blob",
        f"{root}/treatment/-2.blob",
        f"{root}/../x/2.blob",
        "file:///etc/passwd",
        "s3://other-bucket/weights/treatment/2.blob",
        "https://example.com/treatment/2.blob",
    ]
    if isinstance(store, S3BlobStore):
        foreign.append(f"s3://{store.bucket}/other-prefix/treatment/2.blob")
        foreign.append(f"s3://{store.bucket}/treatment/2.blob")
    else:
        foreign.append(f"file://{store.root.parent}/elsewhere/treatment/2.blob")
        foreign.append(f"file://otherhost{store.root}/treatment/2.blob")
    for uri in foreign:
        assert not store.owns(uri), uri
        for method in (functools.partial(store.read, size=4), store.exists, store.delete):
            with pytest.raises(ValueError):
                method(uri)
    assert store.read(f"{root}/treatment/{name}", 4) == b"blob"


def test_open_store_follows_blob_url(tmp_path):
    stack = StackSettings(state_dir=tmp_path / "state")
    default = open_store(WeightSyncSettings(), stack)
    assert (
        isinstance(default, LocalBlobStore)
        and default.root == (tmp_path / "state" / "blobs").resolve()
    )
    elsewhere = open_store(WeightSyncSettings(blob_url=(tmp_path / "blobs dir").as_uri()), stack)
    assert (
        isinstance(elsewhere, LocalBlobStore)
        and elsewhere.root == (tmp_path / "blobs dir").resolve()
    )
    s3 = open_store(WeightSyncSettings(blob_url="s3://bucket-1/a/b/", **S3_LOGIN), stack)
    assert isinstance(s3, S3BlobStore) and (s3.bucket, s3.prefix, s3.url) == (
        "bucket-1",
        "a/b",
        "s3://bucket-1/a/b",
    )
    assert s3.key("treatment", 4) == "a/b/treatment/4.blob"
    bare = open_store(WeightSyncSettings(blob_url="s3://bucket-1"), stack)
    assert isinstance(bare, S3BlobStore) and bare.key("control", 0) == "control/0.blob"


@pytest.mark.parametrize(
    ("values", "error"),
    [
        # the bucket is missing, or is no S3 bucket name
        ({"blob_url": "s3://"}, "needs a bucket name"),
        ({"blob_url": "s3:///prefix"}, "needs a bucket name"),
        ({"blob_url": "s3://My_Bucket/x"}, "needs a bucket name"),
        # a prefix that would not round-trip through key names
        ({"blob_url": "s3://bucket/a//b"}, "empty, '.' or '..' segment"),
        ({"blob_url": "s3://bucket/a/../b"}, "empty, '.' or '..' segment"),
        ({"blob_url": "s3://bucket/a?versionId=1"}, "query or fragment"),
        # local directories are absolute file:// URLs, nothing else
        ({"blob_url": "file://host/blobs"}, "file:///absolute/path"),
        ({"blob_url": "/var/blobs"}, "must be ''"),
        ({"blob_url": "gs://bucket/x"}, "must be ''"),
        # S3 settings without an S3 store are a forgotten blob_url
        ({"s3_endpoint_url": "http://minio:9000"}, "s3_endpoint_url set, but blob_url"),
        ({"blob_url": "file:///blobs", "s3_secret_access_key": "s"}, "s3_secret_access_key set"),
        # half a credential
        ({"blob_url": "s3://bucket", "s3_access_key_id": "id"}, "go together"),
        ({"blob_url": "s3://bucket", "s3_secret_access_key": "secret"}, "go together"),
        ({"blob_url": "s3://bucket", "s3_endpoint_url": "minio:9000"}, "must be http"),
    ],
)
def test_bad_blob_store_settings_fail_at_start(values, error):
    with pytest.raises(ValueError, match=error):
        WeightSyncSettings(**values)


def test_blob_store_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("RTRL_WEIGHT_SYNC_BLOB_URL", "s3://weights/prod")
    monkeypatch.setenv("RTRL_WEIGHT_SYNC_S3_ENDPOINT_URL", "https://minio.internal:9000")
    monkeypatch.setenv("RTRL_WEIGHT_SYNC_S3_ACCESS_KEY_ID", "id")
    monkeypatch.setenv("RTRL_WEIGHT_SYNC_S3_SECRET_ACCESS_KEY", "very-secret")
    settings = WeightSyncSettings()
    assert (
        settings.blob_url == "s3://weights/prod"
        and settings.s3_secret_access_key.get_secret_value() == "very-secret"
    )
    assert "very-secret" not in repr(settings)


@pytest.mark.integration
def test_weight_sync_with_blobs_in_s3(redis_url, tmp_path, s3_endpoint, s3_bucket, policy_weights):
    stack = StackSettings(redis_url=redis_url, state_dir=tmp_path / "state")
    settings = WeightSyncSettings(
        port=procs.free_port(), chunk_bytes=64 * 1024, keyframe_every=3, gc_interval_s=0,
        blob_url=f"s3://{s3_bucket}/rtrl", s3_endpoint_url=s3_endpoint, keep_keyframes=1, **S3_LOGIN,
    )  # fmt: skip
    server = InProcessServer(settings, stack)
    server.start()
    publisher = Publisher(
        server.addr,
        stack.weight_sync_token.get_secret_value(),
        "treatment",
        keyframe_every=3,
        signing_key=MANIFEST_KEY,
    )
    try:
        versions = publish_versions(publisher, policy_weights, 5)  # keyframes v0, v3
        # Each version's manifest lies beside its blob, for rebuilding a lost registry.
        assert s3_keys(s3_endpoint, s3_bucket) == sorted(
            f"rtrl/treatment/{v}.{kind}" for v in range(5) for kind in ("blob", "manifest")
        )
        following = Following(
            Subscriber(
                server.addr,
                "treatment",
                "worker-s3",
                token=SUBSCRIBE_TOKEN,
                public_keys=MANIFEST_PUBLIC_KEYS,
            )
        )
        try:
            received = following.until(4)
        finally:
            following.stop()
        assert [(m.version, m.keyframe) for m, _ in received] == [(3, True), (4, False)]
        assert_bit_identical(received[-1][1], versions[4])

        plans = server._run(server.running.collect_garbage())
        assert [(p.arm, p.versions) for p in plans] == [("treatment", (0, 1, 2))]
        assert s3_keys(s3_endpoint, s3_bucket) == [
            f"rtrl/treatment/{v}.{kind}" for v in (3, 4) for kind in ("blob", "manifest")
        ]
        following = Following(
            Subscriber(
                server.addr,
                "treatment",
                "worker-s3b",
                token=SUBSCRIBE_TOKEN,
                public_keys=MANIFEST_PUBLIC_KEYS,
            )
        )
        try:
            received = following.until(4)
        finally:
            following.stop()
        assert [m.version for m, _ in received] == [3, 4]
        assert_bit_identical(received[-1][1], versions[4])
    finally:
        publisher.close()
        server.close()
