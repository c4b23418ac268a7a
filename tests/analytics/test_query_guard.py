"""The sink's /query endpoint cannot leave the project's tables (guarantee 7).

Every query the report, `rtrl status`, the demo and the tests send passes
analytics/sql_guard.py and answers exactly what the unguarded client answers; every
escape below is refused with the part that broke the rule, in process and through a
running sink with its real token, and nothing is written anywhere.
"""

from __future__ import annotations

import secrets
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rtrl import procs, topics
from rtrl.analytics import report, schema, training_report
from rtrl.analytics.query import client_query_fn, connect, http_query_fn, project_tables
from rtrl.analytics.sql_guard import Refused, checked_sql
from rtrl.ops.reporting import landed
from support import signed
from support.analytics import hand_made_records

OUTFILE = "/tmp/rtrl-query-guard-outfile.csv"

# (what it tries, the query). Each must be refused before ClickHouse sees it.
ESCAPES = [
    # table functions that read files, the network, processes or other databases
    ("file", "SELECT * FROM file('/etc/passwd', 'LineAsString')"),
    ("file, backquoted", "SELECT * FROM `file`('/etc/passwd', 'LineAsString')"),
    ("file, double-quoted", "SELECT * FROM \"file\"('/etc/passwd', 'LineAsString')"),
    (
        "file, comment inside the name's call",
        "SELECT * FROM file/**/('/proc/self/environ', 'LineAsString')",
    ),
    ("file, upper case", "SELECT * FROM FILE('/etc/hostname', 'LineAsString')"),
    ("file, mixed case", "SELECT * FROM FiLe('/etc/hostname', 'LineAsString')"),
    (
        "file in a subquery",
        "SELECT count() FROM (SELECT * FROM file('/etc/hostname', 'LineAsString'))",
    ),
    (
        "file in a CTE",
        "WITH x AS (SELECT * FROM file('/etc/hostname', 'LineAsString')) SELECT * FROM x",
    ),
    (
        "file in a UNION",
        "SELECT rollout_id FROM rollouts UNION ALL SELECT line FROM file('/etc/hostname', 'LineAsString')",
    ),
    (
        "file in a join",
        "SELECT * FROM rollouts AS r JOIN file('/etc/hostname', 'LineAsString') AS f ON 1 = 1",
    ),
    (
        "file in IN",
        "SELECT count() FROM rollouts WHERE rollout_id IN (SELECT line FROM file('/etc/hostname', 'LineAsString'))",
    ),
    (
        "file as a scalar subquery",
        "SELECT (SELECT any(line) FROM file('/etc/hostname', 'LineAsString')) AS h",
    ),
    ("fileCluster", "SELECT * FROM fileCluster('c', '/etc/passwd')"),
    ("url (SSRF)", "SELECT * FROM url('http://127.0.0.1:6379/', 'LineAsString')"),
    ("url, comment", "SELECT * FROM url/**/('http://127.0.0.1:6379/', 'LineAsString')"),
    ("urlCluster", "SELECT * FROM urlCluster('c', 'http://127.0.0.1/')"),
    ("s3", "SELECT * FROM s3('http://127.0.0.1:9000/b/k', 'CSV')"),
    ("remote", "SELECT * FROM remote('127.0.0.1:9000', system.one)"),
    ("remoteSecure", "SELECT * FROM remoteSecure('127.0.0.1:9440', system.one)"),
    ("cluster", "SELECT * FROM cluster('default', system.one)"),
    ("mysql", "SELECT * FROM mysql('127.0.0.1:3306', 'test', 't', 'root', '')"),
    ("postgresql", "SELECT * FROM postgresql('127.0.0.1:5432', 'test', 't', 'root', '')"),
    ("redis", "SELECT * FROM redis('127.0.0.1:6379', 'k', 'k String')"),
    ("mongodb", "SELECT * FROM mongodb('127.0.0.1:27017', 'd', 'c', 'u', 'p', 'x String')"),
    ("odbc", "SELECT * FROM odbc('DSN=x', 't')"),
    ("jdbc", "SELECT * FROM jdbc('jdbc:x', 't')"),
    ("executable", "SELECT * FROM executable('id', 'TabSeparated', 'x String')"),
    ("python", "SELECT * FROM python('x')"),
    ("input", "SELECT * FROM input('x String')"),
    ("numbers (a table function, if harmless)", "SELECT * FROM numbers(10)"),
    ("generateRandom", "SELECT * FROM generateRandom('a String') LIMIT 1"),
    ("merge over other databases", "SELECT * FROM merge('system', '.*')"),
    # tables that are not ours
    ("system table", "SELECT * FROM system.tables"),
    ("system users", "SELECT name FROM system.users"),
    ("system settings", "SELECT name, value FROM system.settings"),
    ("system processes", "SELECT query FROM system.processes"),
    ("qualified own table", "SELECT * FROM default.rollouts"),
    ("information_schema", "SELECT * FROM information_schema.tables"),
    ("unknown table", "SELECT * FROM passwords"),
    ("system via a join", "SELECT * FROM rollouts JOIN system.one ON 1 = 1"),
    # functions that reach outside the row
    ("dictGet", "SELECT dictGet('d', 'x', 1)"),
    ("currentUser", "SELECT currentUser() AS u"),
    ("hostName", "SELECT hostName() AS h"),
    ("getSetting", "SELECT getSetting('readonly') AS r"),
    ("sleep", "SELECT sleep(3)"),
    ("file as a function", "SELECT file('/etc/hostname') AS x"),
    ("url as a function", "SELECT url('http://127.0.0.1/') AS x"),
    (
        "arrayReduce naming a function not allowed",
        "SELECT arrayReduce('groupArrayInsertAt', [1]) AS x",
    ),
    ("arrayReduce with a computed name", "SELECT arrayReduce(concat('s', 'um'), [1]) AS x"),
    ("throwIf", "SELECT throwIf(1) AS x"),
    ("unknown column", "SELECT password FROM rollouts"),
    ("virtual column _path", "SELECT _path FROM rollouts"),
    # statements other than one SELECT
    ("two statements", "SELECT 1; DROP TABLE rollouts"),
    ("a SELECT then an INSERT", "SELECT 1; INSERT INTO rollouts (rollout_id) VALUES ('x')"),
    ("WITH then DROP", "WITH 1 AS x SELECT x FROM system.one; DROP TABLE rewards"),
    ("DROP", "DROP TABLE rollouts"),
    ("TRUNCATE", "TRUNCATE TABLE rewards"),
    ("INSERT", "INSERT INTO rollouts (rollout_id) VALUES ('x')"),
    ("INSERT SELECT from a file", "INSERT INTO rollouts SELECT * FROM file('/etc/hostname')"),
    ("ALTER DELETE", "ALTER TABLE rollouts DELETE WHERE 1"),
    ("CREATE", "CREATE TABLE t (x String) ENGINE = Memory"),
    ("CREATE AS file", "CREATE TABLE t ENGINE = File(CSV, '/tmp/x') AS SELECT 1"),
    ("ATTACH", "ATTACH TABLE t FROM '/tmp' (x String)"),
    ("SYSTEM", "SYSTEM SHUTDOWN"),
    ("SET", "SET readonly = 0"),
    ("KILL", "KILL QUERY WHERE 1"),
    ("OPTIMIZE", "OPTIMIZE TABLE rollouts FINAL"),
    ("GRANT", "GRANT ALL ON *.* TO default"),
    ("SHOW", "SHOW TABLES"),
    ("DESCRIBE", "DESCRIBE TABLE rollouts"),
    ("EXPLAIN", "EXPLAIN SELECT 1"),
    # clauses that change how a SELECT runs or where it goes
    ("SETTINGS", "SELECT 1 AS x SETTINGS readonly = 0"),
    ("SETTINGS in a subquery", "SELECT * FROM (SELECT 1 AS x SETTINGS max_execution_time = 0)"),
    ("SETTINGS max_result_rows", "SELECT rollout_id FROM rollouts SETTINGS max_result_rows = 0"),
    ("FORMAT", "SELECT 1 FORMAT JSON"),
    ("INTO OUTFILE", f"SELECT 1 INTO OUTFILE '{OUTFILE}'"),
    (
        "INTO OUTFILE in a subquery's place",
        f"SELECT * FROM rollouts INTO OUTFILE '{OUTFILE}' FORMAT CSV",
    ),
    # text that is not a query
    ("empty", ""),
    ("only a comment", "-- nothing"),
    ("a query parameter", "SELECT {x:String} AS x"),
    ("garbage", "SELEKT * FROM rollouts"),
    ("unterminated string", "SELECT 'x"),
    ("too long", "SELECT 1 AS x" + " " * 20_001),
]


def test_at_least_fifty_escapes_are_listed():
    assert len(ESCAPES) >= 50 and len({name for name, _ in ESCAPES}) == len(ESCAPES)


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """The project's schema in a chdb of its own, with the hand-made records of test_analytics."""
    from rtrl.config import StackSettings

    stack = StackSettings(clickhouse_url=f"chdb://{tmp_path_factory.mktemp('chdb')}/db")
    client = connect(stack)
    schema.create_tables(client)
    rollouts, rewards = hand_made_records()
    # The recording double stands in for the sink's confluent_kafka Consumer.
    sink = signed.checking_sink(client)
    for topic, messages in ((topics.ROLLOUT, rollouts), (topics.REWARD, rewards)):
        for offset, message in enumerate(messages):
            sink.add(
                signed.record(
                    topic, 0, offset, message.rollout_id.encode(), message.SerializeToString()
                )
            )
    sink.flush()
    yield client, project_tables(client)
    client.close()


@pytest.mark.parametrize("name, sql", ESCAPES, ids=[name for name, _ in ESCAPES])
def test_every_escape_is_refused_by_the_guard(tables, name, sql):
    _, allowed = tables
    with pytest.raises(Refused) as refused:
        checked_sql(sql, allowed)
    assert str(refused.value), "a refusal says why"


def test_the_report_status_and_demo_queries_pass_the_guard_and_answer_the_same(tables):
    client, allowed = tables
    plain = client_query_fn(client)
    seen: list[str] = []

    def guarded(sql: str):
        seen.append(sql)
        return plain(checked_sql(sql, allowed))

    assert report.ab_table(guarded) == report.ab_table(plain)
    assert report.by_version(guarded) == report.by_version(plain)
    assert report.by_hour(guarded) == report.by_hour(plain)
    assert training_report.reward_components(guarded) == training_report.reward_components(plain)
    assert training_report.trainer_steps(guarded) == training_report.trainer_steps(plain)
    assert landed(guarded) == landed(plain)
    assert len(seen) >= 10


def test_string_values_stay_values(tables):
    """SQL inside a string literal is data: it passes, and ClickHouse compares it as text."""
    client, allowed = tables
    sql = checked_sql(
        "SELECT count() AS n FROM rollouts WHERE rollout_id = 'x''; DROP TABLE rollouts; --'",
        allowed,
    )
    assert client_query_fn(client)(sql) == [{"n": 0}]
    assert client_query_fn(client)("SELECT count() AS n FROM rollouts") != [{"n": 0}]


@pytest.mark.guarantee(7)
@pytest.mark.integration
def test_a_running_sink_refuses_escapes_strangers_and_huge_answers_and_writes_nothing(
    stack_env, tmp_path, repo_root
):
    port, token = procs.free_port(), secrets.token_urlsafe(16)
    env = {
        **stack_env,
        "RTRL_ANALYTICS_QUERY_PORT": str(port),
        "RTRL_ANALYTICS_QUERY_TOKEN": token,
        "RTRL_ANALYTICS_QUERY_MAX_ROWS": "5",
        "PYTHONPATH": str(repo_root),
    }
    sink = procs.spawn(
        "analytics",
        [sys.executable, "-m", "rtrl.analytics"],
        tmp_path / "analytics.log",
        env=env,
        port=port,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        procs.wait_for_port(port, timeout_s=60)
        query = http_query_fn(url, token)
        tables_before = query("SELECT count() AS n FROM rollouts")
        for name, sql in ESCAPES:
            with pytest.raises(RuntimeError, match=r"HTTP 400\).*refused") as refused:
                query(sql)
            assert "refused" in str(refused.value), name

        # No token, a wrong one, another scheme: 401 before the body is looked at.
        for headers in (
            {},
            {"Authorization": "Bearer nope"},
            {"Authorization": f"Basic {token}"},
            {"Authorization": f"Bearer {token}x"},
        ):
            status, body = _post(url, b"{not json at all", headers)
            assert status == 401 and "token" in body, (headers, status, body)
        status, _ = _post(url, b"x" * (1 << 20), {"Authorization": "Bearer nope"})
        assert status == 401
        status, body = _post(url, b"x" * (1 << 20), {"Authorization": f"Bearer {token}"})
        assert status == 413, body

        # Answers past the row bound are refused, not truncated.
        with pytest.raises(RuntimeError, match="HTTP 400.*TOO_MANY_ROWS"):
            query(_ordered_union(7))
        assert query(_ordered_union(3)) == [{"x": 1}, {"x": 2}, {"x": 3}]
        assert query("SELECT count() AS n FROM rollouts") == tables_before
        assert sink.alive(), (tmp_path / "analytics.log").read_text()
    finally:
        sink.stop(timeout_s=30)
    assert not Path(OUTFILE).exists()


def _ordered_union(n: int) -> str:
    """n rows, 1 to n, without a table (the sink under test has none filled)."""
    union = " UNION ALL ".join(f"SELECT {i} AS x" for i in range(1, n + 1))
    return f"SELECT x FROM ({union}) ORDER BY x"


def _post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, str]:
    request = urllib.request.Request(
        url + "/query", data=body, headers={"Content-Type": "application/json", **headers}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


# Joins that pair every row with every row while looking like a join on a condition.
CROSS_JOINS = [
    ("ON 1 = 1", "SELECT count() AS n FROM rollouts AS a JOIN rewards AS b ON 1 = 1"),
    ("ON true", "SELECT count() AS n FROM rollouts AS a JOIN rewards AS b ON true"),
    ("ON a constant", "SELECT count() AS n FROM rollouts AS a JOIN rewards AS b ON 1"),
    (
        "ON a literal equality in parentheses",
        "SELECT count() AS n FROM rollouts AS a JOIN rewards AS b ON (1 = 1)",
    ),
    (
        "ON a column equal to itself",
        "SELECT count() AS n FROM rollouts AS a JOIN rewards AS b ON a.arm = a.arm",
    ),
    (
        "ON an equality within one table",
        "SELECT count() AS n FROM rollouts AS a JOIN rewards AS b ON a.arm = a.rollout_id",
    ),
    (
        "ON a column equal to a constant",
        "SELECT count() AS n FROM rollouts AS a JOIN rewards AS b ON a.arm = 'control'",
    ),
    (
        "ON an equality OR true",
        "SELECT count() AS n FROM rollouts AS a JOIN rewards AS b"
        " ON a.rollout_id = b.rollout_id OR 1 = 1",
    ),
    (
        "ON an inequality",
        "SELECT count() AS n FROM rollouts AS a JOIN rewards AS b ON a.rollout_id != b.rollout_id",
    ),
    (
        "ON a comparison",
        "SELECT count() AS n FROM rollouts AS a LEFT JOIN rewards AS b"
        " ON a.rollout_id > b.rollout_id",
    ),
    (
        "ON an equality of expressions, not columns",
        "SELECT count() AS n FROM rollouts AS a JOIN rewards AS b ON length(a.arm) = length('x')",
    ),
    ("CROSS JOIN", "SELECT count() AS n FROM rollouts AS a CROSS JOIN rewards AS b"),
    ("a comma join", "SELECT count() AS n FROM rollouts AS a, rewards AS b"),
    (
        "a comma join with a WHERE",
        "SELECT count() AS n FROM rollouts AS a, rewards AS b WHERE a.rollout_id = b.rollout_id",
    ),
    (
        "ON 1 = 1 in a subquery",
        "SELECT n FROM (SELECT count() AS n FROM rollouts AS a JOIN rewards AS b ON 1 = 1)",
    ),
]

# Joins on an equality between the two sides' columns, which the report's queries use.
EQUI_JOINS = [
    "SELECT count() AS n FROM rollouts AS a JOIN rewards AS b ON a.rollout_id = b.rollout_id",
    "SELECT count() AS n FROM rollouts AS a LEFT JOIN rewards AS b"
    " ON (a.rollout_id = b.rollout_id) AND b.reward > 0",
    "SELECT count() AS n FROM rollouts AS a JOIN rewards AS b"
    " ON b.reward > 0 AND a.rollout_id = b.rollout_id AND a.arm = 'control'",
    "SELECT count() AS n FROM rollouts AS a JOIN rewards AS b USING (rollout_id)",
    "SELECT count() AS n FROM rollouts JOIN rewards ON rollouts.rollout_id = rewards.rollout_id",
]


@pytest.mark.guarantee(7)
@pytest.mark.parametrize("name, sql", CROSS_JOINS, ids=[name for name, _ in CROSS_JOINS])
def test_a_join_without_an_equality_between_its_sides_columns_is_refused(tables, name, sql):
    """L10: `JOIN ... ON 1=1` was a cross join in disguise (every pair of rows): a join must
    pair rows on an equality between a column of each side (or USING), as a conjunct of ON."""
    _, allowed = tables
    with pytest.raises(Refused, match="join"):
        checked_sql(sql, allowed)


@pytest.mark.parametrize("sql", EQUI_JOINS, ids=range(len(EQUI_JOINS)))
def test_a_join_on_an_equality_between_its_sides_columns_passes(tables, sql):
    client, allowed = tables
    assert client_query_fn(client)(checked_sql(sql, allowed))
