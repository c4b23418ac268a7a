"""The query endpoint closes connections that never finish a request (issue 24): headers
cut off, a body that stops arriving, an idle keep-alive connection; and answers the
operator meanwhile. The deadlines are rtrl/http_limits.py's, set small here."""

from __future__ import annotations

import sys

import pytest

from rtrl import procs
from rtrl.analytics.query import http_query_fn
from support import wait
from support.slow_clients import (
    HANG_S,
    STALLED_PER_CASE,
    Stalled,
    stalls,
)

pytestmark = pytest.mark.integration

TOKEN = "operator-token"


@pytest.mark.guarantee(7)
def test_the_query_endpoint_closes_connections_that_never_finish_a_request(
    stack_env, tmp_path, repo_root
):
    port = procs.free_port()
    env = {
        **stack_env, "RTRL_ANALYTICS_QUERY_PORT": str(port), "RTRL_ANALYTICS_QUERY_TOKEN": TOKEN,
        "RTRL_ANALYTICS_HTTP_HEADER_TIMEOUT_S": "1", "RTRL_ANALYTICS_HTTP_BODY_TIMEOUT_S": "1",
        "RTRL_ANALYTICS_HTTP_KEEPALIVE_TIMEOUT_S": "2", "PYTHONPATH": str(repo_root),
    }  # fmt: skip
    log = tmp_path / "analytics.log"
    sink = procs.spawn(
        "analytics", [sys.executable, "-m", "rtrl.analytics"], log, env=env, port=port
    )
    watching = [wait.Watched(sink, log)]
    attacks: dict[str, Stalled] = {}
    try:
        procs.wait_for_port(port, timeout_s=60)
        cases = stalls("/query", "/healthz", {"Authorization": f"Bearer {TOKEN}"})
        attacks = {case: Stalled(port, sent, STALLED_PER_CASE) for case, sent in cases.items()}
        query = http_query_fn(f"http://127.0.0.1:{port}", TOKEN, timeout_s=10)
        assert query("SELECT count() AS n FROM rollouts") == [{"n": 0}]  # answered meanwhile
        for case, stalled in attacks.items():
            wait.until(
                stalled.still_open, f"the endpoint to close every '{case}' connection",
                ready=lambda n: n == 0, timeout_s=HANG_S, watching=watching,
            )  # fmt: skip
        idle = attacks["idle after a request"]
        assert all(got.startswith(b"HTTP/1.1 200") for got in idle.received.values())
    finally:
        for stalled in attacks.values():
            stalled.close()
        sink.stop(timeout_s=20)
