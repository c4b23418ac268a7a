"""Every process's Prometheus endpoint closes connections that never finish a request or a
TLS handshake (issue 24), and serves scrapes meanwhile: it is an rtrl/http_limits.py
listener like the services' APIs, its deadline (RTRL_METRICS_CLIENT_TIMEOUT_S) set small
here. The weight_sync process stands for every service: they share rtrl/otel.py."""

from __future__ import annotations

import ssl
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from rtrl import procs
from support import wait
from support.slow_clients import Stalled, stalls

pytestmark = pytest.mark.integration

STALLED = 50
HANG_S = 30.0
"""Far past the deadline below: only a listener that never closes them waits this long."""


def _serve_metrics(
    stack, tmp_path: Path, repo_root: Path, **env: str
) -> tuple[procs.Proc, int, wait.Watched]:
    port, metrics_port = procs.free_port(), procs.free_port()
    env = {
        "RTRL_REDIS_URL": stack.redis_url, "RTRL_STATE_DIR": str(stack.state_dir),
        "RTRL_WEIGHT_SYNC_PORT": str(port), "RTRL_METRICS_PORT": str(metrics_port),
        "RTRL_METRICS_CLIENT_TIMEOUT_S": "1", "PYTHONPATH": str(repo_root), **env,
    }  # fmt: skip
    log = tmp_path / "weight_sync.log"
    proc = procs.spawn(
        "weight_sync", [sys.executable, "-m", "rtrl.weight_sync"], log, env=env, port=port
    )
    procs.wait_for_port(metrics_port, timeout_s=60)
    return proc, metrics_port, wait.Watched(proc, log)


def _scrape(url: str, context: ssl.SSLContext | None = None) -> bytes:
    with urllib.request.urlopen(url, timeout=10, context=context) as response:
        return response.read()


@pytest.mark.guarantee(7)
def test_the_metrics_endpoint_closes_connections_that_never_finish_a_request(
    stack, tmp_path, repo_root
):
    proc, port, watched = _serve_metrics(stack, tmp_path, repo_root)
    cases = stalls("/metrics", "/metrics")
    attacks: dict[str, Stalled] = {}
    try:
        attacks = {
            case: Stalled(port, cases[case], STALLED)
            for case in ("headers never finished", "idle after a request")
        }
        assert b"# TYPE " in _scrape(f"http://127.0.0.1:{port}/metrics")  # served meanwhile
        for case, stalled in attacks.items():
            wait.until(
                stalled.still_open, f"the endpoint to close every '{case}' connection",
                ready=lambda n: n == 0, timeout_s=HANG_S, watching=[watched],
            )  # fmt: skip
    finally:
        for stalled in attacks.values():
            stalled.close()
        proc.stop()


@pytest.mark.guarantee(7)
def test_silent_clients_of_the_tls_metrics_endpoint_block_no_scrape(stack, tmp_path, repo_root):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    proc, port, watched = _serve_metrics(
        stack, tmp_path, repo_root,
        RTRL_METRICS_TLS_CERT_FILE=str(cert), RTRL_METRICS_TLS_KEY_FILE=str(key),
    )  # fmt: skip
    silent = None
    try:
        silent = Stalled(port, b"", STALLED)  # connected, and never a ClientHello
        context = ssl.create_default_context(cafile=str(cert))
        assert b"# TYPE " in _scrape(f"https://127.0.0.1:{port}/metrics", context)
        wait.until(
            silent.still_open, "the endpoint to close every silent connection",
            ready=lambda n: n == 0, timeout_s=HANG_S, watching=[watched],
        )  # fmt: skip
    finally:
        if silent is not None:
            silent.close()
        proc.stop()
