"""Deadlines on every HTTP listener of the stack: the one way a service serves HTTP.

A connection costs the server a socket and a task whether or not its request ever
arrives, and none of this is behind authentication (the credentials are in the headers).
So every listener (the serving API, the ingest gateway, the analytics query endpoint,
each process's Prometheus endpoint) is started by ``serve_http`` and closes:

- a connection whose request line and headers are not complete ``header_timeout_s``
  after it opened, or after the first byte of a request that follows another; for TLS,
  the handshake has as long again;
- a request whose body (announced by Content-Length or chunked) is not complete
  ``body_timeout_s`` after its headers: a deadline, not a minimum rate, so a client
  trickling one byte a second gains nothing;
- a keep-alive connection idle ``keepalive_timeout_s`` after its last response
  (aiohttp's own timer, which also closes a connection whose next request is still
  incomplete when it fires).

A connection closed for a deadline gets no response (as nginx's client_header_timeout):
it is logged at INFO by what ran out. tests/rtrl/test_http_listeners.py fails on any
listener the stack starts another way.

aiohttp (3.x) has the keep-alive timer but no header or body deadline, so
``_DeadlineRequestHandler`` adds them to its RequestHandler, reading three of its
attributes (``_waiter``: waiting for a request; ``_request_count``: requests parsed;
``_messages``: parsed, not yet handled). The attack tests of each listener
(tests/*/test_*_slow_clients.py) pin that to the installed version.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import ssl
import threading
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HTTPLimits:
    """The deadlines of one listener, in seconds (the module docstring says from when;
    HTTPListener their defaults)."""

    header_timeout_s: float
    body_timeout_s: float
    keepalive_timeout_s: float


class HTTPListener(BaseModel):
    """Mixed into the settings of each service with an HTTP API (as rtrl.tls.TLSListener),
    so the variables are ``RTRL_<SERVICE>_HTTP_HEADER_TIMEOUT_S`` and so on."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    http_header_timeout_s: float = Field(10.0, gt=0, le=600)
    """A connection whose request line and headers are not all in this long after it opened
    (or after the first byte of its next request) is closed without an answer; with TLS,
    the handshake has as long again before that."""

    http_body_timeout_s: float = Field(60.0, gt=0, le=3600)
    """A request whose body is not all in this long after its headers is closed without an
    answer: raise it if clients send large bodies over slow links."""

    http_keepalive_timeout_s: float = Field(15.0, gt=0, le=3600)
    """A keep-alive connection idle this long after its last answer is closed."""

    def http_limits(self) -> HTTPLimits:
        return HTTPLimits(
            self.http_header_timeout_s, self.http_body_timeout_s, self.http_keepalive_timeout_s
        )


async def serve_http(
    app: web.Application,
    host: str,
    port: int,
    limits: HTTPLimits,
    ssl_context: ssl.SSLContext | None = None,
    shutdown_timeout_s: float = 60.0,
) -> web.AppRunner:
    """``app`` listening on ``host:port`` (0: a free port, see ``runner.addresses``) under
    ``limits``; the caller cleans the runner up, which lets requests in flight finish
    within ``shutdown_timeout_s``."""
    runner = _DeadlineAppRunner(app, limits, access_log=None, shutdown_timeout=shutdown_timeout_s)
    await runner.setup()
    await _DeadlineSite(runner, host, port, ssl_context, limits.header_timeout_s).start()
    return runner


def serve_http_in_thread(
    app: web.Application,
    host: str,
    port: int,
    limits: HTTPLimits,
    ssl_context: ssl.SSLContext | None = None,
) -> None:
    """``serve_http`` for a process whose main thread runs no asyncio loop of its own (the
    Prometheus endpoint of every service): on a daemon thread with its own loop, for the
    life of the process. Returns once it listens; raises OSError if it cannot bind."""
    listening: concurrent.futures.Future[None] = concurrent.futures.Future()

    def run() -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(serve_http(app, host, port, limits, ssl_context))
        except BaseException as exc:  # raised again in the caller's thread
            listening.set_exception(exc)
            loop.close()
            return
        listening.set_result(None)
        loop.run_forever()

    threading.Thread(target=run, name=f"http-{host}:{port}", daemon=True).start()
    listening.result()


class _DeadlineRequestHandler(RequestHandler):
    """aiohttp's protocol for one connection, plus the header and body deadlines."""

    __slots__ = ("_limits", "_deadline", "_expired")

    def __init__(self, manager: web.Server, *, limits: HTTPLimits, **kwargs: Any) -> None:
        super().__init__(manager, keepalive_timeout=limits.keepalive_timeout_s, **kwargs)
        self._limits = limits
        self._deadline: asyncio.TimerHandle | None = None
        """The one running: a connection is never both before headers and in a body."""
        self._expired: str | None = None
        """What ran out, once the connection was closed for it."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._start_deadline("request headers", self._limits.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        if data and self._deadline is None and self._waiter is not None:
            # The first byte of a request after another: the keep-alive wait is over.
            self._start_deadline("request headers", self._limits.header_timeout_s)
        parsed = self._request_count
        super().data_received(data)
        if self._request_count == parsed:
            return
        self._stop_deadline()
        # Only the last request parsed can still be waiting for its body.
        payload = self._messages[-1][1] if self._messages else None
        if payload is not None and not payload.is_eof():
            body = self._start_deadline("request body", self._limits.body_timeout_s)
            payload.on_eof(lambda: self._stop_deadline(body))

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_deadline()
        super().connection_lost(exc)

    def log_exception(self, *args: Any, **kw: Any) -> None:
        # A handler whose body read we cut off fails with "Connection lost": that is
        # the deadline working, logged once in _expire, not a server error.
        if self._expired is None:
            super().log_exception(*args, **kw)

    def _start_deadline(self, what: str, timeout_s: float) -> asyncio.TimerHandle:
        self._stop_deadline()
        self._deadline = self._loop.call_later(timeout_s, self._expire, what, timeout_s)
        return self._deadline

    def _stop_deadline(self, which: asyncio.TimerHandle | None = None) -> None:
        """Cancel the running deadline (only if it is ``which``, when given)."""
        if self._deadline is not None and which in (None, self._deadline):
            self._deadline.cancel()
            self._deadline = None

    def _expire(self, what: str, timeout_s: float) -> None:
        self._deadline = None
        if self.transport is None:
            return
        self._expired = what
        log.info(
            "closed a connection from %s: %s incomplete after %g s", self.peername, what, timeout_s
        )
        self.force_close()


class _DeadlineServer(web.Server):
    """aiohttp's connection factory, making ``_DeadlineRequestHandler``s."""

    def __init__(self, handler: Any, *, limits: HTTPLimits, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self._limits = limits

    def __call__(self) -> RequestHandler:
        return _DeadlineRequestHandler(self, loop=self._loop, limits=self._limits, **self._kwargs)


class _DeadlineAppRunner(web.AppRunner):
    """An AppRunner (the application's start-up and clean-up hooks) over ``_DeadlineServer``."""

    __slots__ = ("_limits",)

    def __init__(self, app: web.Application, limits: HTTPLimits, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._limits = limits

    async def _make_server(self) -> web.Server:
        # The application builds its Server (starting the app, with its handler
        # arguments); the same arguments go to ours, which differs only in its protocol.
        built = await super()._make_server()
        return _DeadlineServer(
            built.request_handler,
            request_factory=built.request_factory,
            handler_cancellation=built.handler_cancellation,
            loop=asyncio.get_running_loop(),
            limits=self._limits,
            **built._kwargs,
        )


class _DeadlineSite(web.BaseSite):
    """A TCP site whose TLS handshake is bounded too (asyncio's default is 60 s, and
    aiohttp's TCPSite does not pass one)."""

    __slots__ = ("_host", "_port", "_handshake_timeout_s")

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        ssl_context: ssl.SSLContext | None,
        handshake_timeout_s: float,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context)
        self._host, self._port = host, port
        self._handshake_timeout_s = handshake_timeout_s

    @property
    def name(self) -> str:
        return f"{'https' if self._ssl_context else 'http'}://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None  # the runner was set up before the site was made
        self._server = await asyncio.get_running_loop().create_server(
            server,
            self._host,
            self._port,
            ssl=self._ssl_context,
            ssl_handshake_timeout=self._handshake_timeout_s if self._ssl_context else None,
            backlog=self._backlog,
        )
