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

from rtrl.analytics.sql_guard import Refused, checked_sql
from rtrl.config import StackSettings

QueryFn = Callable[[str], list[dict[str, Any]]]

_CLIENT = web.AppKey("client", Client)
_TABLES = web.AppKey[dict[str, frozenset[str]]]("tables")
_TOKEN = web.AppKey("token", bytes)
_MAX_ROWS = web.AppKey("max_rows", int)
MAX_BODY_BYTES = 64 * 1024
"""A query is at most sql_guard.MAX_SQL_CHARS; the body is refused past this before parsing."""


def connect(stack: StackSettings, settings: dict[str, Any] | None = None, url: str = ""):
    """A clickhouse-connect client for the configured URL, or ``url`` (a ``chdb://`` DSN
    selects the embedded engine)."""
    url = url or stack.resolved_clickhouse_url()
    if url.startswith("chdb:///"):
        Path(url.removeprefix("chdb://")).mkdir(parents=True, exist_ok=True)
    return clickhouse_connect.get_client(dsn=url, settings=settings)


def read_only_client(
    stack: StackSettings,
    timeout_s: float,
    max_result_rows: int,
    max_result_bytes: int,
    url: str = "",
):
    # readonly=2 still allows per-query settings (needed by the HTTP backend) but no writes
    # and no way back to readonly=0. max_execution_time goes first: it cannot be set after.
    # A result past either bound is an error, never a truncated answer or a sink out of memory.
    return connect(
        stack,
        {
            "max_execution_time": int(math.ceil(timeout_s)),
            "readonly": 2,
            "max_result_rows": max_result_rows,
            "max_result_bytes": max_result_bytes,
            "result_overflow_mode": "throw",
            "max_memory_usage": 1 << 30,
        },
        url,
    )


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
    client: Client, tables: dict[str, frozenset[str]], token: str, max_rows: int
) -> web.Application:
    """``POST /query`` with ``Authorization: Bearer <token>`` and ``{"sql": "SELECT …"}`` ->
    ``{"columns": [...], "rows": [{...}]}``; the SQL must pass analytics/sql_guard.py. With
    an empty token every query is refused (there is no default token)."""
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_authenticated])
    app[_CLIENT] = client
    app[_TABLES] = tables
    app[_TOKEN] = token.encode()
    app[_MAX_ROWS] = max_rows
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
        body = await request.json()
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
        result = await asyncio.to_thread(request.app[_CLIENT].query, sql)
    except ClickHouseError as exc:
        return web.json_response({"error": str(exc)[:2000]}, status=400)
    if len(result.result_rows) > request.app[_MAX_ROWS]:
        # ClickHouse bounds results read from tables (max_result_rows); this bounds the rest.
        return web.json_response(
            {
                "error": f"the answer has more than {request.app[_MAX_ROWS]} rows (TOO_MANY_ROWS): narrow the query"
            },
            status=400,
        )
    columns = list(result.column_names)
    rows = [
        {c: jsonable(v) for c, v in zip(columns, row, strict=True)} for row in result.result_rows
    ]
    return web.json_response({"columns": columns, "rows": rows})


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})
