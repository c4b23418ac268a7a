"""Every HTTP listener of the stack is started by rtrl/http_limits.py (issue 24), so none
is without header, body and keep-alive deadlines: a module that builds a listener any
other way (an aiohttp site or runner, ``web.run_app``, prometheus_client's or the
standard library's servers, a bare asyncio server) fails here, wherever it is in the
installed namespace. Proved on planted modules, as tests/rtrl/test_layers.py is.

gRPC servers are not HTTP/1 listeners and are not matched; faust's own web server
(reward_stream) is started inside faust, out of this check's sight."""

from __future__ import annotations

import ast
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
THE_ONE_PIECE = Path("rtrl/http_limits.py")
LISTENERS = {
    # aiohttp
    "TCPSite", "SockSite", "UnixSite", "NamedPipeSite", "AppRunner", "ServerRunner", "run_app",
    # prometheus_client
    "start_http_server", "start_wsgi_server",
    # the standard library
    "make_server", "HTTPServer", "ThreadingHTTPServer", "WSGIServer", "ThreadingWSGIServer",
    "create_server", "start_server", "create_unix_server", "start_unix_server",
}  # fmt: skip
"""Names whose call starts (or builds what starts) a listener."""


def sources(root: Path) -> list[Path]:
    """Every module of the installed namespace, read through rtrl/'s symlinks."""
    found = []
    for directory, _, files in os.walk(root / "rtrl", followlinks=True):
        found += [Path(directory) / name for name in sorted(files) if name.endswith(".py")]
    return found


def listeners_built_aside(root: Path) -> list[str]:
    """``path:line name`` of each call of a LISTENERS name outside the one piece."""
    found = []
    for path in sources(root):
        relative = path.relative_to(root)
        if relative == THE_ONE_PIECE:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in LISTENERS:
                found.append(f"{relative}:{node.lineno} {name}")
    return found


def test_every_http_listener_is_started_by_http_limits():
    assert listeners_built_aside(REPO) == []


PLANTED = {
    # case: (module planted, its source, what is found, if anything)
    "a service serving with its own aiohttp site": (
        "inference/planted.py",
        "from aiohttp import web\nasync def f(runner):\n    await web.TCPSite(runner, 'h', 1).start()\n",
        "TCPSite",
    ),
    "a service with a runner of its own": (
        "analytics/planted.py",
        "from aiohttp.web import AppRunner\nrunner = AppRunner(app)\n",
        "AppRunner",
    ),
    "the foundation serving metrics with prometheus_client": (
        "rtrl/planted.py",
        "from prometheus_client import start_http_server\nstart_http_server(9000)\n",
        "start_http_server",
    ),
    "a shell tool with a bare asyncio server": (
        "ops/planted.py",
        "import asyncio\nasync def f(cb):\n    await asyncio.start_server(cb, 'h', 1)\n",
        "start_server",
    ),
    "a runner in an annotation only": (
        "ingest/planted.py",
        "from aiohttp import web\nrunner: web.AppRunner | None = None\n",
        None,
    ),
    "a listener through the one piece": (
        "ingest/planted.py",
        "from rtrl.http_limits import serve_http\nasync def f(app, limits):\n"
        "    return await serve_http(app, 'h', 1, limits)\n",
        None,
    ),
}


def test_a_planted_listener_built_aside_is_caught(tmp_path):
    for case, (planted, source, expected) in PLANTED.items():
        root = tmp_path / case.replace(" ", "_")
        (root / "rtrl").mkdir(parents=True)
        for folder in ("inference", "analytics", "ingest", "ops"):
            (root / folder).mkdir()
            (root / "rtrl" / folder).symlink_to(f"../{folder}")
        (root / THE_ONE_PIECE).write_text("from aiohttp import web\nweb.AppRunner(app)\n")
        (root / planted).write_text(source)
        found = [entry.rpartition(" ")[2] for entry in listeners_built_aside(root)]
        assert found == ([expected] if expected else []), case
