"""What every gRPC listener holds its clients to, like rtrl/http_limits.py for HTTP.

gRPC reads a unary call's whole message into memory before its handler runs, so a handler
that checks the key first still holds every keyless message whole (24 of 15 MiB grew the
gateway by 540 MB). ``CredentialsFirst`` is a server interceptor: it runs when a call's
metadata has arrived and before its message is read, and refuses a call whose credentials
do not pass with a handler that never reads the message (a request-streaming one: on the
wire a unary request is the same), so what a keyless client sent beyond HTTP/2's flow
control window is never taken in. A message is also never larger than the listener's
``max_receive_message_length``, which is the HTTP door's body limit.

A connection's life is bounded by the server (``GRPCListener``): one without a call for
``grpc_idle_timeout_s`` is sent GOAWAY and closed, and the server pings a quiet connection
every ``grpc_keepalive_s`` and drops it when the ping is not answered. Where calls are short
(``GRPCAgedListener``: the gateway), every connection is also closed
``grpc_max_connection_age_s`` after it opened (its calls get ``grpc_connection_age_grace_s``
to finish first), so a slow sender cannot hold one forever.
gRPC clients reconnect on their own after a GOAWAY.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from pydantic import BaseModel, ConfigDict, Field

CredentialsCheck = Callable[[dict[str, str]], Awaitable[tuple[grpc.StatusCode, str] | None]]
"""A call's metadata -> None to serve it, or the code and message it is refused with."""


class GRPCListener(BaseModel):
    """Mixed into the settings of each service with a gRPC listener, so the variables are
    ``RTRL_<SERVICE>_GRPC_IDLE_TIMEOUT_S`` and so on."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    grpc_idle_timeout_s: float = Field(60.0, gt=0, le=24 * 3600)
    """A gRPC connection with no call for this long is closed by the server (GOAWAY); the
    client reconnects for its next call."""

    grpc_keepalive_s: float = Field(60.0, ge=1, le=24 * 3600)
    """The server pings a connection after this long without traffic and closes it when no
    answer comes within 20 s (a peer that vanished without closing)."""

    def grpc_server_options(self, max_message_bytes: int) -> list[tuple[str, Any]]:
        """The options of a ``grpc.aio.server``: messages up to ``max_message_bytes``, and
        the connection bounds above."""
        return [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_connection_idle_ms", _ms(self.grpc_idle_timeout_s)),
            ("grpc.keepalive_time_ms", _ms(self.grpc_keepalive_s)),
            ("grpc.keepalive_timeout_ms", 20_000),
            # Clients may ping as they like while they have calls; never a flood without any.
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ]


class GRPCAgedListener(GRPCListener):
    """A gRPC listener whose calls are short, so every connection can be given an age: a
    slow sender is cut off. (weight_sync's Subscribe streams run for hours: not there.)"""

    grpc_max_connection_age_s: float = Field(600.0, gt=0, le=7 * 24 * 3600)
    """Every gRPC connection is closed this long after it opened (GOAWAY; calls under way get
    grpc_connection_age_grace_s more), so no client holds one for ever."""

    grpc_connection_age_grace_s: float = Field(60.0, gt=0, le=24 * 3600)
    """How long calls under way on a connection past its age may still finish: a message
    sent slower than this is cut off."""

    def grpc_server_options(self, max_message_bytes: int) -> list[tuple[str, Any]]:
        return [
            *super().grpc_server_options(max_message_bytes),
            ("grpc.max_connection_age_ms", _ms(self.grpc_max_connection_age_s)),
            ("grpc.max_connection_age_grace_ms", _ms(self.grpc_connection_age_grace_s)),
        ]


class CredentialsFirst(grpc.aio.ServerInterceptor):
    """Refuses a call from its metadata, before its message is read (the module docstring)."""

    def __init__(self, check: CredentialsCheck) -> None:
        self._check = check

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        metadata = {
            key: value if isinstance(value, str) else value.decode("latin-1")
            for key, value in handler_call_details.invocation_metadata or ()
        }
        refusal = await self._check(metadata)
        if refusal is None:
            return await continuation(handler_call_details)
        code, message = refusal

        async def refuse(_requests: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(code, message)

        return grpc.stream_unary_rpc_method_handler(refuse)


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))
