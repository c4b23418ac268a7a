"""A completion as server-sent events (a request with ``stream: true``): one event per
token as the engine samples it, then the whole answer, then ``data: [DONE]``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from aiohttp import web

from rtrl.inference.openai_errors import error_body


class SampledToken(NamedTuple):
    """One token as the engine sampled it, handed from the engine thread to the stream."""

    token_id: int
    logprob: float
    version: int


class TokenStream:
    """The event stream of one completion. Text is decoded whole after every token (a
    byte-level token may be half of a character), and its last characters, as many as the
    longest stop string, are held back: they could still turn out to be part of one. The
    final event sends what remains of the answer's text."""

    def __init__(
        self,
        response: web.StreamResponse,
        decode: Callable[[Sequence[int]], str],
        rollout_id: str,
        holdback: int,
    ) -> None:
        self.response = response
        self._decode = decode
        self._rollout_id = rollout_id
        self._holdback = holdback
        self.sent = 0
        """Characters of text sent so far."""

    @classmethod
    async def open(
        cls,
        request: web.Request,
        decode: Callable[[Sequence[int]], str],
        rollout_id: str,
        stop: Sequence[str],
    ) -> TokenStream:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        return cls(response, decode, rollout_id, max((len(s) for s in stop), default=0))

    async def relay(self, tokens: asyncio.Queue[SampledToken], waiting: asyncio.Future) -> None:
        """Send an event per token until the completion is done (or has failed)."""
        ids: list[int] = []
        while not (waiting.done() and tokens.empty()):
            getter = asyncio.ensure_future(tokens.get())
            await asyncio.wait({getter, waiting}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                continue
            token = getter.result()
            ids.append(token.token_id)
            text = self._decode(ids)
            delta = text[self.sent : max(self.sent, len(text) - self._holdback)]
            self.sent += len(delta)
            await self.response.write(
                event(
                    {
                        "rollout_id": self._rollout_id,
                        "token_id": token.token_id,
                        "logprob": token.logprob,
                        "policy_version": token.version,
                        "delta": delta,
                    }
                )
            )

    async def finish(self, answer: dict[str, Any], text: str) -> web.StreamResponse:
        """The whole answer, with the text held back so far, then the end of the stream."""
        await self.response.write(event({**answer, "delta": text[self.sent :]}))
        await self.response.write(b"data: [DONE]\n\n")
        return self.response

    async def fail(self, error: str) -> web.StreamResponse:
        """An error event ends a stream whose status line (200) has already gone, in
        OpenAI's shape: its SDKs raise it as the stream's error."""
        await self.response.write(event(error_body(503, error)))
        return self.response


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"
