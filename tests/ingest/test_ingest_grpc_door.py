"""The gateway's gRPC door is held like its HTTP door (guarantee 7, M5): the key
is checked from the metadata before a message is read, and connections that go idle are
closed by the server.

The attack this answers: 24 keyless 15 MiB messages, each buffered whole before the
handler looked at the key, grew the gateway by 540 MB; and a connection that never sent
anything was held open for as long as its client liked.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from support.gateway import GatewayProcess, issue

pytestmark = pytest.mark.integration

MESSAGE_BYTES = 15 << 20
KEYLESS_MESSAGES = 24
METHOD = "/rtrl.v1.Ingest/PublishEvents"


def _peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set (VmHWM), from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


async def _send_keyless(
    port: int, metadata: tuple[tuple[str, str], ...], message_bytes: int = MESSAGE_BYTES
) -> list[grpc.StatusCode]:
    """KEYLESS_MESSAGES messages of ``message_bytes`` at once, each on a channel of its own."""
    payload = b"\x0a" + b"\xff" * (message_bytes - 1)  # never parsed if refused first

    async def one() -> grpc.StatusCode:
        options = [("grpc.max_send_message_length", MESSAGE_BYTES + 1024)]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            call = channel.unary_unary(METHOD)
            try:
                await call(payload, metadata=metadata, timeout=60)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

    return await asyncio.gather(*(one() for _ in range(KEYLESS_MESSAGES)))


@pytest.mark.guarantee(7)
def test_keyless_messages_are_refused_before_they_are_buffered(stack_env, repo_root, tmp_path):
    """M5: a keyless client's big messages are refused from their metadata, without the
    gateway's memory growing by what they carry (24 x 15 MiB grew it by 540 MB)."""
    gateway = GatewayProcess(stack_env, repo_root, tmp_path / "ingest.log")
    gateway.start()
    try:
        procs_pid = gateway.proc.pid if gateway.proc else 0
        # One small call first: gRPC's first calls allocate what every later call reuses.
        warm = asyncio.run(_send_keyless(gateway.grpc_port, (), message_bytes=1024))
        assert set(warm) == {grpc.StatusCode.UNAUTHENTICATED}, warm
        before = _peak_rss_bytes(procs_pid)
        for metadata in ((), (("authorization", "Bearer not-a-key"),)):
            codes = asyncio.run(_send_keyless(gateway.grpc_port, metadata))
            assert set(codes) == {grpc.StatusCode.UNAUTHENTICATED}, codes
        grown = _peak_rss_bytes(procs_pid) - before
        sent = 2 * KEYLESS_MESSAGES * MESSAGE_BYTES
        # What arrives before the refusal is at most a connection's HTTP/2 flow-control
        # window (~0.5 MiB each here), not the messages: held whole, they grew it ~650 MiB.
        assert grown < sent // 10, f"peak RSS grew {grown >> 20} MiB for {sent >> 20} MiB sent"
    finally:
        gateway.stop()


@pytest.mark.guarantee(7)
def test_a_connection_left_idle_is_closed_by_the_gateway(stack_env, repo_root, tmp_path, redis_url):
    """M5: a connection that stops sending is closed after grpc_idle_timeout_s (it was held
    open forever); a client with a key is served on a new one as before."""
    gateway = GatewayProcess(stack_env, repo_root, tmp_path / "ingest.log", grpc_idle_timeout_s=1.0)
    gateway.start()
    key = issue(redis_url, "idler")

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
            await asyncio.wait_for(channel.channel_ready(), 30)
            call = channel.unary_unary(METHOD)
            answer = await call(b"", metadata=(("authorization", f"Bearer {key}"),), timeout=30)
            assert answer == b""  # an empty batch: served, nothing to answer
            ready = grpc.ChannelConnectivity.READY
            assert channel.get_state() == ready
            # The server's GOAWAY takes the channel out of READY; the client never would.
            await asyncio.wait_for(channel.wait_for_state_change(ready), 30)
            assert channel.get_state() in (
                grpc.ChannelConnectivity.IDLE,
                grpc.ChannelConnectivity.TRANSIENT_FAILURE,
                grpc.ChannelConnectivity.CONNECTING,
            )
            answer = await call(b"", metadata=(("authorization", f"Bearer {key}"),), timeout=30)
            assert answer == b""

    try:
        asyncio.run(scenario())
    finally:
        gateway.stop()
