"""Clients that hold an HTTP listener's connections open without ever finishing a request
(a "slowloris"), for the attack tests of guarantee 7: a listener must close each of them
within its header, body or keep-alive deadline, and keep serving everyone else meanwhile.

``Stalled`` opens raw sockets, sends each the bytes of one case and then nothing, and
counts how many the server has not closed yet without blocking, so it can be polled by
``support.wait.until`` (a listener in another process) or ``until_async`` (a listener on
the test's own event loop).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Mapping

import aiohttp

from support import wait

HOST = "127.0.0.1"


def stalls(post_path: str, idle_path: str, headers: Mapping[str, str] = {}) -> dict[str, bytes]:
    """What each kind of stalled client sends before it goes silent: headers cut off in the
    middle of a line; complete headers announcing a 1,000-byte body of which one byte
    comes; one whole request to ``idle_path`` (answered), then an idle keep-alive
    connection. ``headers`` (credentials) make the server read the body rather than
    refuse it unread."""
    head = f"POST {post_path} HTTP/1.1\r\nHost: {HOST}\r\n" + "".join(
        f"{name}: {value}\r\n" for name, value in headers.items()
    )
    return {
        "headers never finished": (head + "X-Slow: ").encode(),
        "body never finished": (
            head + "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
        ).encode(),
        "idle after a request": f"GET {idle_path} HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode(),
    }


class Stalled:
    """``count`` connections to ``port``, each sent ``sent`` and then nothing more."""

    def __init__(self, port: int, sent: bytes, count: int) -> None:
        self.sockets = [socket.create_connection((HOST, port), timeout=10) for _ in range(count)]
        self.received = {sock: b"" for sock in self.sockets}
        for sock in self.sockets:
            if sent:
                sock.sendall(sent)
            sock.setblocking(False)
        self._open = set(self.sockets)

    def still_open(self) -> int:
        """How many the server has not closed yet; reads (and keeps) what it sent, never waits."""
        for sock in list(self._open):
            try:
                data = sock.recv(64 * 1024)
            except BlockingIOError:
                continue
            except ConnectionError:
                data = b""
            if data:
                self.received[sock] += data
            else:
                self._open.discard(sock)
        return len(self._open)

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


STALLED_PER_CASE = 50
"""Connections opened per case."""
HANG_S = 30.0
"""How long a listener may take to close them before the test calls it a hang."""


async def closes_every_stalled_connection(port: int, cases: Mapping[str, bytes], who: str) -> None:
    """For a listener on this test's own event loop: open STALLED_PER_CASE connections per
    case, check ``/healthz`` is answered meanwhile, then wait until ``who`` has closed every
    one (the idle ones after answering their request)."""
    # Opened from a thread: the server accepting them runs on this loop.
    attacks = {
        case: await asyncio.to_thread(Stalled, port, sent, STALLED_PER_CASE)
        for case, sent in cases.items()
    }
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://{HOST}:{port}/healthz") as resp:
                assert resp.status == 200  # served while the stalled connections are open
        for case, stalled in attacks.items():
            await wait.until_async(
                stalled.still_open, f"{who} to close every '{case}' connection",
                ready=lambda n: n == 0, timeout_s=HANG_S,
            )  # fmt: skip
        idle = attacks["idle after a request"]
        assert all(got.startswith(b"HTTP/1.1 200") for got in idle.received.values())
    finally:
        for stalled in attacks.values():
            stalled.close()
