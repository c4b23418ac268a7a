"""A TCP proxy on loopback that breaks connections on purpose, for fault-injection tests.

Put it between a client and a server (``FaultProxy(server_port)``, then connect the
client to ``proxy.addr``) and, while traffic flows:

- ``cut_all()`` resets every connection at once, as a crashed peer or a dropped
  link would;
- ``cut_after(n)`` resets whichever connection carries the n-th byte from the
  server to the client from now on, exactly there: a client that keeps reading
  receives the first n bytes and then a reset, usually in the middle of a message;
- ``hold()`` / ``release()`` park new connections before they reach the server
  (the client's connect succeeds, nothing answers), so a test can change the
  server's state between a cut and the client's reconnect;
- ``throttle(bytes_per_s)`` slows each connection's server-to-client direction, so
  a transfer lasts long enough to be interrupted from the test thread.

It runs an asyncio loop on its own thread; every method may be called from any
other thread. Counters are read without locks (plain ints, written by the loop).
"""

from __future__ import annotations

import asyncio
import collections
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # typing.Self is 3.11's: the client SDK's tests use this under 3.10 too
    from typing import Self

_READ_BYTES = 64 * 1024


@dataclass(eq=False)
class _Link:
    """One client connection and, once it is let through, its connection to the server."""

    client_reader: asyncio.StreamReader
    client_writer: asyncio.StreamWriter
    server_writer: asyncio.StreamWriter | None = None
    next_send_at: float = field(default_factory=time.monotonic)

    def writers(self) -> list[asyncio.StreamWriter]:
        return [w for w in (self.client_writer, self.server_writer) if w is not None]


@dataclass
class _Cut:
    bytes_left: int
    hold: bool
    done: threading.Event = field(default_factory=threading.Event)


class FaultProxy:
    def __init__(
        self, target_port: int, *, target_host: str = "127.0.0.1", bytes_per_s: float | None = None
    ) -> None:
        self.target = (target_host, target_port)
        self.connections = 0
        """Client connections accepted so far."""
        self.bytes_to_client = 0
        """Bytes forwarded from the server to clients so far, over all connections."""
        self._bytes_per_s = bytes_per_s
        self._links: set[_Link] = set()
        self._handlers: set[asyncio.Task] = set()
        self._planned_cuts: collections.deque[_Cut] = collections.deque()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="netfault", daemon=True)
        self._thread.start()
        self._let_through = self._on_loop(self._make_event())
        self._server = self._on_loop(asyncio.start_server(self._accept, "127.0.0.1", 0))
        self.port: int = self._server.sockets[0].getsockname()[1]
        self.addr = f"127.0.0.1:{self.port}"

    # --- faults, called from the test thread -------------------------------------

    def cut_all(self) -> int:
        """Reset every open connection (held ones too); returns how many."""

        async def cut_all() -> int:
            links = list(self._links)
            for link in links:
                self._cut(link)
            return len(links)

        return self._on_loop(cut_all())

    def cut_after(self, n_bytes: int, *, hold: bool = False) -> threading.Event:
        """Reset the connection that carries the n_bytes-th server-to-client byte, counted
        from when the cuts planned before this one are done. With hold, connections opened
        after the cut are held until release(). The returned event is set at the cut."""
        if n_bytes < 1:
            raise ValueError(f"n_bytes must be at least 1, not {n_bytes}")
        cut = _Cut(n_bytes, hold)

        async def plan() -> None:
            self._planned_cuts.append(cut)

        self._on_loop(plan())
        return cut.done

    def hold(self) -> None:
        """Connections accepted from now on wait, unanswered, until release()."""
        self._loop.call_soon_threadsafe(self._let_through.clear)

    def release(self) -> None:
        self._loop.call_soon_threadsafe(self._let_through.set)

    def throttle(self, bytes_per_s: float | None) -> None:
        """Limit every connection's server-to-client rate; None lifts the limit."""
        self._loop.call_soon_threadsafe(setattr, self, "_bytes_per_s", bytes_per_s)

    def close(self) -> None:
        """Stop listening, reset every connection and stop the loop thread."""

        async def close() -> None:
            self._server.close()
            for link in list(self._links):
                self._cut(link)
            self._let_through.set()  # held connections wake, find themselves cut, and end
            if self._handlers:
                await asyncio.wait(self._handlers, timeout=10)
            await self._server.wait_closed()

        if self._loop.is_closed():
            return
        self._on_loop(close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # --- the loop's side ---------------------------------------------------------

    def _on_loop(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    @staticmethod
    async def _make_event() -> asyncio.Event:
        event = asyncio.Event()
        event.set()
        return event

    async def _accept(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        self.connections += 1
        link = _Link(client_reader, client_writer)
        self._links.add(link)
        handler = asyncio.current_task()
        assert handler is not None  # a connection callback runs as a task
        self._handlers.add(handler)
        # drain() then waits until the kernel has every byte, so a cut drops nothing the
        # proxy counted as forwarded (abort() discards the transport's buffer).
        client_writer.transport.set_write_buffer_limits(high=0)
        try:
            await self._let_through.wait()
            if link not in self._links:  # cut while held
                return
            try:
                server_reader, link.server_writer = await asyncio.open_connection(*self.target)
            except OSError:
                self._cut(
                    link
                )  # the client sees what it would without a proxy: a refused/reset connection
                return
            await asyncio.gather(
                self._pump(link, client_reader, link.server_writer, to_client=False),
                self._pump(link, server_reader, client_writer, to_client=True),
            )
        finally:
            self._close(link)
            self._handlers.discard(handler)

    async def _pump(
        self,
        link: _Link,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        to_client: bool,
    ) -> None:
        try:
            while link in self._links:
                data = await reader.read(self._read_size() if to_client else _READ_BYTES)
                if not data:
                    break
                cut_here = False
                if to_client:
                    data, cut_here = self._spend(data)
                writer.write(data)
                await writer.drain()
                if to_client:
                    self.bytes_to_client += len(data)
                    await self._pace(link, len(data))
                if cut_here:
                    self._cut(link)
                    return
        except OSError:
            pass  # the other side reset or the link was cut: ending the link is all there is to do
        self._close(link)

    def _read_size(self) -> int:
        if self._bytes_per_s is None:
            return _READ_BYTES
        # About 20 ms of traffic per read keeps the pace smooth.
        return max(1024, min(_READ_BYTES, int(self._bytes_per_s / 50)))

    def _spend(self, data: bytes) -> tuple[bytes, bool]:
        """The part of data to forward, and whether to cut the link right after it."""
        if not self._planned_cuts:
            return data, False
        cut = self._planned_cuts[0]
        if len(data) < cut.bytes_left:
            cut.bytes_left -= len(data)
            return data, False
        self._planned_cuts.popleft()
        if cut.hold:
            self._let_through.clear()
        data = data[: cut.bytes_left]
        cut.done.set()
        return data, True

    async def _pace(self, link: _Link, sent: int) -> None:
        if self._bytes_per_s is None:
            return
        link.next_send_at = max(link.next_send_at, time.monotonic()) + sent / self._bytes_per_s
        await asyncio.sleep(max(0.0, link.next_send_at - time.monotonic()))

    def _cut(self, link: _Link) -> None:
        """Reset both sides: SO_LINGER 0 makes close() send RST, as a dead peer's kernel would."""
        if link not in self._links:
            return
        for writer in link.writers():
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        self._links.discard(link)

    def _close(self, link: _Link) -> None:
        """End a link whose other side closed: the remaining side is closed normally."""
        if link not in self._links:
            return
        self._links.discard(link)
        for writer in link.writers():
            writer.close()
