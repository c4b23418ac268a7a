"""The sink's /query answers what nests too deeply with a 400, not a 500 (guarantee 7,
L4): a body nested past the JSON bound, and SQL whose subqueries, parentheses or
NOTs nest past what the guard reads; the sink answers the next query."""

from __future__ import annotations

import json
import secrets
import sys
import urllib.error
import urllib.request

import pytest

from rtrl import procs
from rtrl.analytics.query import http_query_fn

DEEP = 30_000


def _subqueries(depth: int) -> str:
    sql = "SELECT 1 AS x"
    for _ in range(depth):
        sql = f"SELECT x FROM ({sql})"
    return sql


DEEP_BODIES = [
    ("a body nested 30k deep", '{"sql": ' + "[" * DEEP + "]" * DEEP + "}"),
    ("200 nested subqueries", json.dumps({"sql": _subqueries(200)})),
    ("parentheses 2,000 deep", json.dumps({"sql": "SELECT " + "(" * 2000 + "1" + ")" * 2000})),
    ("NOT 3,000 times", json.dumps({"sql": "SELECT " + "NOT " * 3000 + "1 AS x"})),
]


@pytest.mark.guarantee(7)
@pytest.mark.integration
def test_deeply_nested_queries_are_a_400_and_the_sink_answers_on(stack_env, tmp_path, repo_root):
    """L4: 200 nested subqueries (and a 30k-deep body, within the 64 KiB body limit) were a
    500 from a RecursionError."""
    port, token = procs.free_port(), secrets.token_urlsafe(16)
    env = {
        **stack_env,
        "RTRL_ANALYTICS_QUERY_PORT": str(port),
        "RTRL_ANALYTICS_QUERY_TOKEN": token,
        "PYTHONPATH": str(repo_root),
    }
    sink = procs.spawn(
        "analytics",
        [sys.executable, "-m", "rtrl.analytics"],
        tmp_path / "analytics.log",
        env=env,
        port=port,
    )
    url = f"http://127.0.0.1:{port}/query"
    try:
        procs.wait_for_port(port, timeout_s=60)
        for name, body in DEEP_BODIES:
            status, text = _post(url, body.encode(), token)
            assert status == 400 and ("nest" in text), (name, status, text[:300])
        query = http_query_fn(f"http://127.0.0.1:{port}", token)
        assert query(_subqueries(8)) == [{"x": 1}]
        assert sink.alive(), (tmp_path / "analytics.log").read_text()
    finally:
        sink.stop(timeout_s=30)


def _post(url: str, body: bytes, token: str) -> tuple[int, str]:
    request = urllib.request.Request(
        url,
        data=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
