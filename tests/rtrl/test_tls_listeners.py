"""TLS available on every listener (issue 17): the serving API, the analytics query
endpoint and weight_sync speak TLS only once given a certificate (the ingest gateway's own
test is tests/ingest/test_ingest_auth.py::test_tls_only_when_configured). Each is reached with
the CA, and refused without it or in plaintext."""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from rtrl import procs
from rtrl.analytics.query import http_query_fn
from rtrl.inference.config import InferenceSettings
from rtrl.inference.engine import Engine, EngineConfig
from rtrl.inference.server import start as start_inference
from rtrl.weight_sync.client import Publisher, Subscriber, latest_version
from rtrl.weight_sync.config import WeightSyncSettings
from support.weight_sync import (
    ARM,
    MANIFEST_KEY,
    MANIFEST_PUBLIC_KEYS,
    SUBSCRIBE_TOKEN,
    Following,
    InProcessServer,
    assert_bit_identical,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    where = tmp_path_factory.mktemp("tls")
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def _get(url: str, cafile: Path | None, **headers) -> tuple[int, bytes]:
    context = ssl.create_default_context(cafile=str(cafile)) if cafile else None
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_weight_sync_over_tls(stack, policy_weights, certificate):
    cert, key = certificate
    settings = WeightSyncSettings(
        port=procs.free_port(), poll_interval_s=0.2, tls_cert_file=cert, tls_key_file=key
    )
    server = InProcessServer(settings, stack)
    server.start()
    publisher = Publisher(
        server.addr,
        stack.weight_sync_token.get_secret_value(),
        ARM,
        signing_key=MANIFEST_KEY,
        tls_ca_file=cert,
    )
    following = Following(
        Subscriber(
            server.addr,
            ARM,
            "worker-tls",
            token=SUBSCRIBE_TOKEN,
            public_keys=MANIFEST_PUBLIC_KEYS,
            tls_ca_file=cert,
        )
    )
    try:
        assert publisher.publish(policy_weights) == 0
        manifest, weights = following.next()
        assert manifest.version == 0
        assert_bit_identical(weights, policy_weights)
        assert latest_version(server.addr, SUBSCRIBE_TOKEN, ARM, tls_ca_file=cert) == 0
        with pytest.raises(grpc.RpcError) as plaintext:
            latest_version(server.addr, SUBSCRIBE_TOKEN, ARM, timeout_s=3)
        assert plaintext.value.code() in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        )
    finally:
        following.stop()
        publisher.close()
        server.close()


def test_the_serving_api_over_tls(stack_settings, certificate):
    cert, key = certificate
    settings = InferenceSettings(
        http_port=procs.free_port(),
        follow_weights=False,
        auth_required=False,
        tls_cert_file=cert,
        tls_key_file=key,
    )

    async def scenario() -> None:
        server = await start_inference(stack_settings, settings, engine=Engine(EngineConfig()))
        try:
            url = f"https://127.0.0.1:{settings.http_port}/healthz"
            status, body = await asyncio.to_thread(_get, url, cert)
            assert status == 200 and json.loads(body)["worker_id"] == "inference-0"
            with pytest.raises(urllib.error.URLError):  # a certificate nobody vouched for
                await asyncio.to_thread(_get, url, None)
            with pytest.raises(
                (urllib.error.URLError, ConnectionError)
            ):  # plaintext to a TLS listener
                await asyncio.to_thread(
                    _get, f"http://127.0.0.1:{settings.http_port}/healthz", None
                )
        finally:
            await server.stop()

    asyncio.run(scenario())


def test_the_query_endpoint_over_tls(stack_env, tmp_path, repo_root, certificate):
    cert, key = certificate
    port = procs.free_port()
    env = {
        **stack_env, "RTRL_ANALYTICS_QUERY_PORT": str(port), "RTRL_ANALYTICS_QUERY_TOKEN": "operator-token",
        "RTRL_ANALYTICS_TLS_CERT_FILE": str(cert), "RTRL_ANALYTICS_TLS_KEY_FILE": str(key),
        "PYTHONPATH": str(repo_root),
    }  # fmt: skip
    sink = procs.spawn(
        "analytics",
        [sys.executable, "-m", "rtrl.analytics"],
        tmp_path / "analytics.log",
        env=env,
        port=port,
    )
    try:
        procs.wait_for_port(port, timeout_s=60)
        assert http_query_fn(f"https://127.0.0.1:{port}", "operator-token", ca_file=cert)(
            "SELECT count() AS n FROM rollouts"
        ) == [{"n": 0}]
        with pytest.raises(
            (RuntimeError, urllib.error.URLError, ConnectionError)
        ):  # plaintext to a TLS listener
            http_query_fn(f"http://127.0.0.1:{port}", "operator-token", timeout_s=10)(
                "SELECT count() AS n FROM rollouts"
            )
        with pytest.raises(urllib.error.URLError):  # a certificate nobody vouched for
            http_query_fn(f"https://127.0.0.1:{port}", "operator-token", timeout_s=10)(
                "SELECT count() AS n FROM rollouts"
            )
    finally:
        sink.stop(timeout_s=20)


def test_the_prometheus_endpoint_over_tls(stack, tmp_path, repo_root, certificate):
    cert, key = certificate
    port, metrics_port = procs.free_port(), procs.free_port()
    env = {
        "RTRL_REDIS_URL": stack.redis_url, "RTRL_STATE_DIR": str(stack.state_dir), "RTRL_WEIGHT_SYNC_PORT": str(port),
        "RTRL_METRICS_PORT": str(metrics_port), "RTRL_METRICS_TLS_CERT_FILE": str(cert),
        "RTRL_METRICS_TLS_KEY_FILE": str(key), "PYTHONPATH": str(repo_root),
    }  # fmt: skip
    server = procs.spawn(
        "weight_sync",
        [sys.executable, "-m", "rtrl.weight_sync"],
        tmp_path / "weight_sync.log",
        env=env,
        port=port,
    )
    try:
        procs.wait_for_port(metrics_port, timeout_s=60)
        status, page = _get(f"https://127.0.0.1:{metrics_port}/metrics", cert)
        assert status == 200 and b"# TYPE " in page
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            _get(f"http://127.0.0.1:{metrics_port}/metrics", None)
    finally:
        server.stop()
