"""/query cannot make rows it then has to hold (guarantee 7).

The attack this answers: `arrayJoin` over three 400-element literals asks for 400^3 = 64 M
rows; the sink built them all, decoded them into Python, and only then counted them
against its row cap (40 s, 613 MB -> 11.7 GB). Row generators are now simply not on the
guard's allow-list, literals are capped, the engine stops a result at the row cap before
it reaches Python, and the answer is read block by block against its row and byte caps.
"""

from __future__ import annotations

import json
import secrets
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from clickhouse_connect.driver.exceptions import ClickHouseError

from rtrl import procs
from rtrl.analytics import query, schema
from rtrl.analytics.query import http_query_fn, project_tables, read_only_client
from rtrl.analytics.sql_guard import (
    MAX_LITERAL_ELEMENTS,
    MAX_STRING_LITERAL_BYTES,
    Refused,
    checked_sql,
)
from rtrl.config import StackSettings

ATTACK_ELEMENTS = 400
"""Elements of each of the three literals in the attack (64 M rows at 400)."""


def _literal(offset: int, n: int = ATTACK_ELEMENTS) -> str:
    # Three different literals: ClickHouse folds identical arrayJoin calls into one.
    return "[" + ", ".join(str(offset + i) for i in range(n)) + "]"


ARRAY_JOIN_ATTACK = (
    f"SELECT arrayJoin({_literal(0)}) AS a, arrayJoin({_literal(1000)}) AS b,"
    f" arrayJoin({_literal(2000)}) AS c"
)
ARRAY_JOIN_CLAUSE_ATTACK = (
    f"SELECT a, b, c FROM (SELECT 1 AS one) ARRAY JOIN {_literal(0)} AS a"
    f" ARRAY JOIN {_literal(1000)} AS b ARRAY JOIN {_literal(2000)} AS c"
)
HUGE_ARRAY_LITERAL = "SELECT length([" + ", ".join(["1"] * 6000) + "]) AS n"

# (what it tries, the query, what the refusal must name). Each makes rows or values out of
# nothing but the query's text; each must be refused before ClickHouse sees it.
GENERATORS = [
    ("arrayJoin over a literal", "SELECT arrayJoin([1, 2, 3]) AS x", "arrayJoin"),
    ("arrayJoin, other case", "SELECT ARRAYJOIN([1, 2, 3]) AS x", "ARRAYJOIN"),
    ("arrayJoin, backquoted", "SELECT `arrayJoin`([1, 2, 3]) AS x", "arrayJoin"),
    (
        "arrayJoin over a table's arrays",
        "SELECT arrayJoin(groupArray(rollout_id)) AS x FROM rollouts",
        "arrayJoin",
    ),
    (
        "arrayJoin in a subquery",
        "SELECT count() AS n FROM (SELECT arrayJoin([1, 2]) AS x)",
        "arrayJoin",
    ),
    ("arrayJoin in a CTE", "WITH t AS (SELECT arrayJoin([1]) AS x) SELECT x FROM t", "arrayJoin"),
    (
        "arrayJoin in WHERE",
        "SELECT count() AS n FROM rollouts WHERE arrayJoin([1, 2]) = 1",
        "arrayJoin",
    ),
    ("ARRAY JOIN clause", "SELECT x FROM rollouts ARRAY JOIN [1, 2] AS x", "ARRAY JOIN"),
    ("LEFT ARRAY JOIN", "SELECT x FROM rollouts LEFT ARRAY JOIN [1, 2] AS x", "ARRAY JOIN"),
    (
        "ARRAY JOIN of a subquery's column",
        "SELECT x FROM (SELECT [1, 2] AS x) AS t ARRAY JOIN x",
        "ARRAY JOIN",
    ),
    ("numbers table function", "SELECT count() AS n FROM numbers(1000000000)", "numbers"),
    ("numbers_mt", "SELECT count() AS n FROM numbers_mt(1000000000)", "numbers_mt"),
    ("zeros", "SELECT count() AS n FROM zeros(1000000000)", "zeros"),
    (
        "generate_series",
        "SELECT count() AS n FROM generate_series(1, 1000000000)",
        "generate_series",
    ),
    ("generateRandom", "SELECT * FROM generateRandom('a UInt8') LIMIT 10", "generateRandom"),
    ("system.numbers", "SELECT count() AS n FROM system.numbers", "system.numbers"),
    ("range", "SELECT length(range(1000000000)) AS n", "range"),
    ("replicate", "SELECT replicate(1, [1, 2, 3]) AS x", "replicate"),
    ("arrayMap over a literal", "SELECT arrayMap(x -> x * 2, [1, 2, 3]) AS x", "arrayMap"),
    ("arrayWithConstant", "SELECT arrayWithConstant(1000000000, 1) AS x", "arrayWithConstant"),
    ("repeat", "SELECT repeat('x', 1000000000) AS x", "repeat"),
    ("replaceAll, an amplifier", "SELECT replaceAll('aa', 'a', 'aaaa') AS x", "replaceAll"),
    (
        "WITH RECURSIVE",
        "WITH RECURSIVE t AS (SELECT 1 AS n UNION ALL SELECT n + 1 AS n FROM t WHERE n < 1000000000)"
        " SELECT count() AS c FROM t",
        "RECURSIVE",
    ),
    ("a cross join by comma", "SELECT count() AS n FROM rollouts AS a, rollouts AS b", "CROSS"),
    ("CROSS JOIN", "SELECT count() AS n FROM rollouts AS a CROSS JOIN rewards AS b", "CROSS"),
    (
        "a join without a condition",
        "SELECT count() AS n FROM rollouts AS a PASTE JOIN rewards AS b",
        "PASTE",
    ),
    ("ORDER BY WITH FILL", "SELECT 1 AS x ORDER BY x WITH FILL FROM 0 TO 1000000000", "FILL"),
    ("GROUP BY WITH CUBE", "SELECT arm, count() AS n FROM rollouts GROUP BY arm WITH CUBE", "CUBE"),
    # literals past their caps
    ("the attack's literals", ARRAY_JOIN_ATTACK.replace("arrayJoin", "length"), "array literal"),
    ("a huge array literal", HUGE_ARRAY_LITERAL, "array literal"),
    (
        "a huge array literal, array()",
        "SELECT length(array(" + ", ".join(["1"] * (MAX_LITERAL_ELEMENTS + 1)) + ")) AS n",
        "array literal",
    ),
    (
        "a huge tuple literal",
        "SELECT (" + ", ".join(["1"] * (MAX_LITERAL_ELEMENTS + 1)) + ") AS t",
        "tuple literal",
    ),
    (
        "a huge string literal",
        "SELECT length('" + "x" * (MAX_STRING_LITERAL_BYTES + 1) + "') AS n",
        "string literal",
    ),
    (
        "a string literal cast to an array",
        "SELECT CAST('[" + ",".join(["1"] * 2000) + "]' AS Array(UInt8)) AS a",
        "string literal",
    ),
]

# Queries the guard keeps: joins with a condition, literals within their caps.
KEPT = [
    "SELECT count() AS n FROM rollouts AS a JOIN rewards AS b ON a.rollout_id = b.rollout_id",
    "SELECT count() AS n FROM rollouts AS a LEFT JOIN rewards AS b USING (rollout_id)",
    "SELECT count() AS n FROM rollouts WHERE arm IN ('control', 'treatment')",
    "SELECT has([" + ", ".join(["1"] * MAX_LITERAL_ELEMENTS) + "], 1) AS x",
    "SELECT length('" + "x" * MAX_STRING_LITERAL_BYTES + "') AS n",
    "SELECT arm, count() AS n FROM rollouts GROUP BY arm WITH TOTALS",
]


@pytest.fixture(scope="module")
def chdb_url(tmp_path_factory) -> str:
    """The project's schema in a chdb of its own (one engine path per process)."""
    return f"chdb://{tmp_path_factory.mktemp('chdb')}/db"


@pytest.fixture(scope="module")
def tables(chdb_url):
    writer = query.connect(StackSettings(clickhouse_url=chdb_url))
    schema.create_tables(writer)
    yield project_tables(writer)
    writer.close()


@pytest.mark.parametrize("name, sql, named", GENERATORS, ids=[name for name, _, _ in GENERATORS])
def test_every_row_generator_is_refused_by_name(tables, name, sql, named):
    with pytest.raises(Refused) as refused:
        checked_sql(sql, tables)
    assert named.lower() in str(refused.value).lower(), str(refused.value)


@pytest.mark.parametrize("sql", KEPT, ids=range(len(KEPT)))
def test_joins_with_a_condition_and_literals_within_their_caps_pass(tables, sql):
    checked_sql(sql, tables)


def test_the_engine_stops_a_generated_result_at_the_row_cap(tables, chdb_url):
    """Unguarded, on the read-only client itself: ClickHouse's max_result_rows alone lets
    rows made from a constant through; the client's limits stop them in the engine."""
    client = read_only_client(StackSettings(clickhouse_url=chdb_url), 30, 1000, 1 << 20)
    try:
        with pytest.raises(ClickHouseError, match="TOO_MANY_ROWS"):
            query.bounded_answer(client, "SELECT arrayJoin(range(1000000)) AS x", 1000, 1 << 20)
        rows = json.loads(
            query.bounded_answer(client, "SELECT arrayJoin(range(1000)) AS x", 1000, 1 << 20)
        )
        assert len(rows["rows"]) == 1000
    finally:
        client.close()


def test_the_engine_holds_a_query_to_its_memory_budget(tables, chdb_url):
    client = read_only_client(
        StackSettings(clickhouse_url=chdb_url), 30, 1000, 1 << 20, max_memory_bytes=32 << 20
    )
    try:
        with pytest.raises(ClickHouseError, match="MEMORY_LIMIT_EXCEEDED"):
            query.bounded_answer(
                client, "SELECT length(groupArray(number)) AS n FROM numbers(50000000)", 10, 1 << 20
            )
    finally:
        client.close()


def test_an_answer_past_its_byte_cap_is_refused_not_cut(tables, chdb_url):
    client = read_only_client(StackSettings(clickhouse_url=chdb_url), 30, 1000, 64 << 20)
    try:
        with pytest.raises(query.AnswerTooLarge, match="bytes"):
            query.bounded_answer(
                client, "SELECT repeat('x', 1000) AS x FROM numbers(500)", 1000, 100_000
            )
    finally:
        client.close()


def test_an_answer_after_one_the_engine_refused_is_its_own(tables, chdb_url):
    """chdb can hand the rows a failed query had written to the next query on the same
    handle; the endpoint reads every answer as a stream, which does not."""
    client = read_only_client(StackSettings(clickhouse_url=chdb_url), 30, 1000, 64 << 20)
    refused = (
        "SELECT toString(number) AS s FROM numbers(500)"
        " UNION ALL SELECT toString(number) AS s FROM numbers(501)"
    )
    try:
        for _ in range(100):
            with pytest.raises(ClickHouseError, match="TOO_MANY_ROWS"):
                query.bounded_answer(client, refused, 1000, 64 << 20)
            assert json.loads(query.bounded_answer(client, "SELECT 42 AS x", 1000, 1 << 20)) == {
                "columns": ["x"],
                "rows": [{"x": 42}],
            }
    finally:
        client.close()


def _peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set so far (VmHWM), from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


@pytest.mark.guarantee(7)
@pytest.mark.integration
def test_a_running_sink_refuses_row_generators_by_name_without_growing(
    stack_env, tmp_path, repo_root
):
    port, token = procs.free_port(), secrets.token_urlsafe(16)
    env = {
        **stack_env,
        "RTRL_ANALYTICS_QUERY_PORT": str(port),
        "RTRL_ANALYTICS_QUERY_TOKEN": token,
        "PYTHONPATH": str(repo_root),
    }
    log = tmp_path / "analytics.log"
    sink = procs.spawn(
        "analytics", [sys.executable, "-m", "rtrl.analytics"], log, env=env, port=port
    )
    url = f"http://127.0.0.1:{port}"
    attacks = [
        (
            f"arrayJoin over three {ATTACK_ELEMENTS}-element literals",
            ARRAY_JOIN_ATTACK,
            "arrayJoin",
        ),
        ("ARRAY JOIN clause over the same literals", ARRAY_JOIN_CLAUSE_ATTACK, "ARRAY JOIN"),
        ("numbers(1e9)", "SELECT count() AS n FROM numbers(1000000000)", "numbers"),
        ("a huge array literal", HUGE_ARRAY_LITERAL, "array literal"),
    ]
    try:
        procs.wait_for_port(port, timeout_s=60)
        assert http_query_fn(url, token)("SELECT count() AS n FROM rollouts") == [{"n": 0}]
        before = _peak_rss_bytes(sink.pid)
        answers = {name: _post(url, token, sql) for name, sql, _ in attacks}
        growth_mb = (_peak_rss_bytes(sink.pid) - before) / (1 << 20)
        not_refused_by_name = {
            name: (status, body[:200])
            for name, _, named in attacks
            for status, body in [answers[name]]
            if status != 400
            or not _refusal(body).startswith("refused:")
            or named.lower() not in _refusal(body).lower()
        }
        assert not not_refused_by_name and growth_mb < 500, (not_refused_by_name, growth_mb)
        assert http_query_fn(url, token)("SELECT count() AS n FROM rollouts") == [{"n": 0}]
        assert sink.alive(), log.read_text()
    finally:
        sink.stop(timeout_s=30)


def _refusal(body: str) -> str:
    try:
        return str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return ""


def _post(url: str, token: str, sql: str) -> tuple[int, str]:
    """(status, body); a generous timeout that only catches a hang."""
    request = urllib.request.Request(
        url + "/query",
        data=json.dumps({"sql": sql}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
