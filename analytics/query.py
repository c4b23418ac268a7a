"""Reading the analytics tables: the ``query_fn`` providers and the sink's ``/query`` endpoint.

chdb is an in-process engine, so while the sink runs it is the only process that can
open the data directory; ``rtrl report``/``status`` then ask the sink over HTTP. When the
stack is down they open the directory (or a ClickHouse server) directly.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import math
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import date, datetime
from pathlib import Path
from typing import Any

import clickhouse_connect
from aiohttp import web
from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import ClickHouseError

from rtrl import bounded_json
from rtrl.analytics.sql_guard import Refused, checked_sql
from rtrl.config import StackSettings

QueryFn = Callable[[str], list[dict[str, Any]]]

_CLIENT = web.AppKey("client", Client)
_TABLES = web.AppKey[dict[str, frozenset[str]]]("tables")
_TOKEN = web.AppKey("token", bytes)
_MAX_ROWS = web.AppKey("max_rows", int)
_MAX_BYTES = web.AppKey("max_bytes", int)
MAX_BODY_BYTES = 64 * 1024
"""A query is at most sql_guard.MAX_SQL_CHARS; the body is refused past this before parsing."""


def connect(stack: StackSettings, settings: dict[str, Any] | None = None, url: str = ""):
    """A clickhouse-connect client for the configured URL, or ``url`` (a ``chdb://`` DSN
    selects the embedded engine)."""
    url = url or stack.resolved_clickhouse_url()
    if url.startswith("chdb:///"):
        Path(url.removeprefix("chdb://")).mkdir(parents=True, exist_ok=True)
    return clickhouse_connect.get_client(dsn=url, settings=settings)


QUERY_MAX_MEMORY_BYTES = 1 << 30
"""What one ``/query`` may use inside the engine (chdb runs in the sink's own process)."""
QUERY_BLOCK_ROWS = 8192
"""Rows per block: the step at which the engine checks its limits and the sink reads."""
QUERY_MAX_EXPANDED_AST = 50_000
"""Nodes of a query once its aliases are expanded: a few kilobytes of SQL whose aliases
nest cannot ask for a tree of millions of nodes."""


def read_only_client(
    stack: StackSettings,
    timeout_s: float,
    max_result_rows: int,
    max_result_bytes: int,
    url: str = "",
    max_memory_bytes: int = QUERY_MAX_MEMORY_BYTES,
):
    """A read-only client held to ``read_limits``: the settings go with every query (SET
    on chdb's handle, URL parameters to a server), and chdb honours them."""
    return connect(
        stack, read_limits(timeout_s, max_result_rows, max_result_bytes, max_memory_bytes), url
    )


def read_limits(
    timeout_s: float, max_result_rows: int, max_result_bytes: int, max_memory_bytes: int
) -> dict[str, Any]:
    """ClickHouse settings that stop a query inside the engine, before its answer exists."""
    # readonly=2 still allows per-query settings (needed by the HTTP backend) but no writes
    # and no way back to readonly=0. max_execution_time goes first: it cannot be set after.
    # A result past either bound is an error, never a truncated answer. ClickHouse applies
    # max_result_rows to rows read from tables but not to rows made from constants (an
    # arrayJoin of a literal); ``limit`` ends every answer one row past the bound, and with
    # it the engine checks those rows too, before they reach the sink.
    return {
        "max_execution_time": int(math.ceil(timeout_s)),
        "readonly": 2,
        "max_result_rows": max_result_rows,
        "max_result_bytes": max_result_bytes,
        "result_overflow_mode": "throw",
        "limit": max_result_rows + 1,
        "max_block_size": QUERY_BLOCK_ROWS,
        "max_expanded_ast_elements": QUERY_MAX_EXPANDED_AST,
        # Memory: a GROUP BY or ORDER BY past half the budget spills to disk, a join's
        # right side past a quarter is an error, anything else past the budget too.
        "max_memory_usage": max_memory_bytes,
        "max_bytes_before_external_group_by": max_memory_bytes // 2,
        "max_bytes_before_external_sort": max_memory_bytes // 2,
        "max_bytes_in_join": max_memory_bytes // 4,
        "join_overflow_mode": "throw",
    }


def project_tables(client) -> dict[str, frozenset[str]]:
    """The project's tables and their columns, as ClickHouse holds them (what /query may read)."""
    result = client.query(
        "SELECT table, name FROM system.columns WHERE database = currentDatabase()"
    )
    tables: dict[str, set[str]] = {}
    for table, column in result.result_rows:
        tables.setdefault(table, set()).add(column)
    return {table: frozenset(columns) for table, columns in tables.items()}


def client_query_fn(client) -> QueryFn:
    def query(sql: str) -> list[dict[str, Any]]:
        result = client.query(sql)
        return [dict(zip(result.column_names, row, strict=True)) for row in result.result_rows]

    return query


def http_query_fn(
    url: str, token: str, timeout_s: float = 30.0, ca_file: Path | None = None
) -> QueryFn:
    """Query the running sink's ``/query`` endpoint (``url`` like ``http://127.0.0.1:8124``,
    or ``https://`` trusting ``ca_file`` when the sink listens with TLS) with the operator's
    query token."""
    endpoint = url.rstrip("/") + "/query"
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
    context = ssl.create_default_context(cafile=str(ca_file)) if ca_file is not None else None

    def query(sql: str) -> list[dict[str, Any]]:
        request = urllib.request.Request(
            endpoint, data=json.dumps({"sql": sql}).encode(), headers=headers
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s, context=context) as response:
                return json.loads(response.read())["rows"]
        except urllib.error.HTTPError as exc:
            raise RuntimeError(
                f"analytics query failed (HTTP {exc.code}): {exc.read().decode(errors='replace')[:500]}"
            ) from exc

    return query


class AnswerTooLarge(ValueError):
    """An answer past ``/query``'s row or byte bound: refused whole, never cut."""


def bounded_answer(client: Client, sql: str, max_rows: int, max_bytes: int) -> bytes:
    """``{"columns": [...], "rows": [{...}]}`` as JSON, read block by block: past
    ``max_rows`` rows or ``max_bytes`` bytes of JSON it raises AnswerTooLarge, so the
    sink holds at most one block beyond its bounds, never the whole result first.

    Reading a stream also keeps each answer its own: chdb's buffered query now and then
    hands the rows a failed query had written to the next query on the same handle."""
    rows: list[str] = []
    size = 0
    with client.query_row_block_stream(sql) as stream:
        for block in stream:
            if len(rows) + len(block) > max_rows:
                raise AnswerTooLarge(
                    f"the answer has more than {max_rows} rows (TOO_MANY_ROWS): narrow the query"
                )
            columns = stream.source.column_names
            for row in block:
                text = json.dumps({c: jsonable(v) for c, v in zip(columns, row, strict=True)})
                size += len(text) + 2
                if size > max_bytes:
                    raise AnswerTooLarge(
                        f"the answer is larger than {max_bytes} bytes (TOO_MANY_BYTES): narrow the query"
                    )
                rows.append(text)
        columns = stream.source.column_names
    return f'{{"columns": {json.dumps(list(columns))}, "rows": [{", ".join(rows)}]}}'.encode()


def jsonable(value: Any) -> Any:
    """Plain JSON for a ClickHouse value: NaN/inf -> null, dates -> ISO 8601, bytes -> base64."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(value).decode()
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v) for v in value]
    return str(value)


def build_query_app(
    client: Client, tables: dict[str, frozenset[str]], token: str, max_rows: int, max_bytes: int
) -> web.Application:
    """``POST /query`` with ``Authorization: Bearer <token>`` and ``{"sql": "SELECT …"}`` ->
    ``{"columns": [...], "rows": [{...}]}``; the SQL must pass analytics/sql_guard.py and
    the answer must fit ``max_rows`` rows and ``max_bytes`` bytes of JSON. With an empty
    token every query is refused (there is no default token)."""
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_authenticated])
    app[_CLIENT] = client
    app[_TABLES] = tables
    app[_TOKEN] = token.encode()
    app[_MAX_ROWS] = max_rows
    app[_MAX_BYTES] = max_bytes
    app.router.add_post("/query", _query)
    app.router.add_get("/healthz", _healthz)
    return app


@web.middleware
async def _authenticated(request: web.Request, handler):
    """The token is checked before anything of the body is read."""
    if request.path == "/healthz":
        return await handler(request)
    expected = request.app[_TOKEN]
    if not expected:
        return web.json_response(
            {
                "error": "this sink has no query token (RTRL_ANALYTICS_QUERY_TOKEN): it answers no queries"
            },
            status=401,
        )
    scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(presented.strip().encode(), expected):
        return web.json_response(
            {"error": "a valid query token is required (Authorization: Bearer …)"}, status=401
        )
    return await handler(request)


async def _query(request: web.Request) -> web.Response:
    try:
        body = bounded_json.loads(await request.read())
        sql = body["sql"] if isinstance(body, dict) else None
        if not isinstance(sql, str):
            raise TypeError("sql must be a string")
    except web.HTTPRequestEntityTooLarge:
        return web.json_response(
            {"error": f"the body is larger than {MAX_BODY_BYTES} bytes"}, status=413
        )
    except (ValueError, KeyError, TypeError) as exc:
        return web.json_response(
            {"error": f'body must be {{"sql": "SELECT …"}}: {exc}'}, status=400
        )
    tables = request.app[_TABLES]
    try:
        sql = checked_sql(sql, tables)
    except Refused as exc:
        return web.json_response({"error": f"refused: {exc}"}, status=400)
    try:
        answer = await asyncio.to_thread(
            bounded_answer,
            request.app[_CLIENT],
            sql,
            request.app[_MAX_ROWS],
            request.app[_MAX_BYTES],
        )
    except (ClickHouseError, AnswerTooLarge) as exc:
        return web.json_response({"error": str(exc)[:2000]}, status=400)
    return web.Response(body=answer, content_type="application/json")


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})
