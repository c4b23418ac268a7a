"""A completion as server-sent events (a request with ``stream: true``), in OpenAI's shape:
``chat.completion.chunk`` chunks for a chat, ``text_completion`` chunks for a prompt, one
per token as the engine samples it, then a last chunk that ends the choice and carries the
whole answer's rtrl fields, then ``data: [DONE]``.

Every chunk also carries the token it was sent for, at the top level where OpenAI's SDKs
keep unknown fields (``token_id``, ``logprob``, ``policy_version``): token out. The text
is released as soon as it decodes whole (inference/detokenize.py), less its last
characters, as many as the longest stop string: they could still turn out to be part of
one."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from aiohttp import web

from rtrl.inference.detokenize import IncrementalText
from rtrl.inference.openai_errors import error_body


class SampledToken(NamedTuple):
    """One token as the engine sampled it, handed from the engine thread to the stream."""

    token_id: int
    logprob: float
    version: int


class TokenStream:
    """The event stream of one completion."""

    def __init__(
        self,
        response: web.StreamResponse,
        decode: Callable[[Sequence[int]], str],
        head: dict[str, Any],
        chat: bool,
        holdback: int,
    ) -> None:
        self.response = response
        self._text = IncrementalText(decode)
        self._head = head
        """What every chunk starts with: id, object, created, model, rollout_id."""
        self._chat = chat
        self._holdback = holdback
        self._decoded = ""
        self._role_sent = False
        self.sent = 0
        """Characters of text sent so far."""

    @classmethod
    async def open(
        cls,
        request: web.Request,
        decode: Callable[[Sequence[int]], str],
        rollout_id: str,
        model: str,
        chat: bool,
        stop: Sequence[str],
    ) -> TokenStream:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        head = {
            "id": rollout_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "rollout_id": rollout_id,
        }
        return cls(response, decode, head, chat, max((len(s) for s in stop), default=0))

    async def relay(self, tokens: asyncio.Queue[SampledToken], waiting: asyncio.Future) -> None:
        """Send a chunk per token until the completion is done (or has failed)."""
        while not (waiting.done() and tokens.empty()):
            getter = asyncio.ensure_future(tokens.get())
            await asyncio.wait({getter, waiting}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                continue
            token = getter.result()
            self._decoded += self._text.add(token.token_id)
            end = max(self.sent, len(self._decoded) - self._holdback)
            delta = self._decoded[self.sent : end]
            self.sent = end
            extra = {
                "token_id": token.token_id,
                "logprob": token.logprob,
                "policy_version": token.version,
            }
            await self.response.write(event(self._chunk(delta, None, extra)))

    async def finish(self, answer: dict[str, Any], text: str) -> web.StreamResponse:
        """The last chunk: the text held back so far, why the choice ended, and the answer's
        own fields (token ids, versions, usage...); then the end of the stream."""
        skip = {"id", "object", "created", "model", "choices", "text"}
        extra = {k: v for k, v in answer.items() if k not in skip}
        await self.response.write(
            event(self._chunk(text[self.sent :], answer["finish_reason"], extra))
        )
        await self.response.write(b"data: [DONE]\n\n")
        return self.response

    async def fail(self, error: str) -> web.StreamResponse:
        """An error event ends a stream whose status line (200) has already gone, in
        OpenAI's shape: its SDKs raise it as the stream's error."""
        await self.response.write(event(error_body(503, error)))
        return self.response

    def _chunk(self, text: str, finish_reason: str | None, extra: dict[str, Any]) -> dict:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self._chat:
            delta = {"content": text}
            if not self._role_sent:  # once, first: OpenAI's SDKs concatenate repeated strings
                delta = {"role": "assistant", **delta}
                self._role_sent = True
            choice["delta"] = delta
        else:
            choice["text"] = text
        return {**self._head, "choices": [choice], **extra}


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"
