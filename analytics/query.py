"""Reading the analytics tables: the ``query_fn`` providers and the sink's ``/query`` endpoint.

chdb is an in-process engine, so while the sink runs it is the only process that can
open the data directory; ``rtrl report``/``status`` then ask the sink over HTTP. When the
stack is down they open the directory (or a ClickHouse server) directly.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import re
import urllib.error
import urllib.request
from datetime import date, datetime
from pathlib import Path
from typing import Any, Callable

import clickhouse_connect
from aiohttp import web
from clickhouse_connect.driver.exceptions import ClickHouseError

from rtrl.config import StackSettings

QueryFn = Callable[[str], list[dict[str, Any]]]

_READ_ONLY = re.compile(r"^\s*(select|with)\b", re.IGNORECASE)
# Table functions that reach outside the tables (files, network, processes, the caller's
# Python objects); readonly does not stop them, so they are refused by name.
_OUTSIDE = re.compile(
    r"\b(file|filecluster|url|urlcluster|s3|s3cluster|gcs|azureblobstorage|hdfs|remote|remotesecure|cluster|"
    r"clusterallreplicas|mysql|postgresql|mongodb|redis|odbc|jdbc|sqlite|executable|python|input|iceberg|deltalake|hudi)\s*\(",
    re.IGNORECASE,
)
_CLIENT = web.AppKey("client", object)


def connect(stack: StackSettings, settings: dict[str, Any] | None = None):
    """A clickhouse-connect client for the configured URL (a ``chdb://`` DSN selects the embedded engine)."""
    url = stack.resolved_clickhouse_url()
    if url.startswith("chdb:///"):
        Path(url.removeprefix("chdb://")).mkdir(parents=True, exist_ok=True)
    return clickhouse_connect.get_client(dsn=url, settings=settings)


def read_only_client(stack: StackSettings, timeout_s: float):
    # readonly=2 still allows per-query settings (needed by the HTTP backend) but no writes
    # and no way back to readonly=0. max_execution_time goes first: it cannot be set after.
    return connect(stack, {"max_execution_time": int(math.ceil(timeout_s)), "readonly": 2})


def client_query_fn(client) -> QueryFn:
    def query(sql: str) -> list[dict[str, Any]]:
        result = client.query(sql)
        return [dict(zip(result.column_names, row)) for row in result.result_rows]

    return query


def http_query_fn(url: str, timeout_s: float = 30.0) -> QueryFn:
    """Query the running sink's ``/query`` endpoint (``url`` like ``http://127.0.0.1:8124``)."""
    endpoint = url.rstrip("/") + "/query"

    def query(sql: str) -> list[dict[str, Any]]:
        request = urllib.request.Request(endpoint, data=json.dumps({"sql": sql}).encode(), headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return json.loads(response.read())["rows"]
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"analytics query failed (HTTP {exc.code}): {exc.read().decode(errors='replace')[:500]}") from exc

    return query


def read_only_sql(sql: str) -> str:
    """The query wrapped as a subquery, which ClickHouse parses as a single SELECT only:
    no second statement, no ``INTO OUTFILE``, no ``FORMAT``. Raises ValueError otherwise."""
    sql = sql.strip().rstrip(";").strip()
    if not _READ_ONLY.match(sql):
        raise ValueError("only SELECT (or WITH … SELECT) queries are allowed")
    if match := _OUTSIDE.search(sql):
        raise ValueError(f"table function {match.group(1)}() is not allowed")
    return f"SELECT * FROM ({sql}\n)"


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


def build_query_app(client) -> web.Application:
    """``POST /query`` with ``{"sql": "SELECT …"}`` -> ``{"columns": [...], "rows": [{...}]}``."""
    app = web.Application()
    app[_CLIENT] = client
    app.router.add_post("/query", _query)
    app.router.add_get("/healthz", _healthz)
    return app


async def _query(request: web.Request) -> web.Response:
    try:
        sql = (await request.json())["sql"]
        if not isinstance(sql, str):
            raise TypeError("sql must be a string")
        sql = read_only_sql(sql)
    except (ValueError, KeyError, TypeError) as exc:
        return web.json_response({"error": f'body must be {{"sql": "SELECT …"}}: {exc}'}, status=400)
    try:
        result = await asyncio.to_thread(request.app[_CLIENT].query, sql)
    except ClickHouseError as exc:
        return web.json_response({"error": str(exc)}, status=400)
    columns = list(result.column_names)
    rows = [{c: jsonable(v) for c, v in zip(columns, row)} for row in result.result_rows]
    return web.json_response({"columns": columns, "rows": rows})


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def query_fn_for(stack: StackSettings, query_url: str) -> QueryFn:
    """The running sink's endpoint if it answers, else the tables opened directly."""
    try:
        with urllib.request.urlopen(query_url.rstrip("/") + "/healthz", timeout=1):
            return http_query_fn(query_url)
    except OSError:
        return client_query_fn(connect(stack))
