"""A completion as server-sent events (a request with ``stream: true``), in OpenAI's shape:
``chat.completion.chunk`` chunks for a chat, ``text_completion`` chunks for a prompt, one
per token as the engine samples it, then a last chunk that ends the choice and carries the
whole answer's rtrl fields, then ``data: [DONE]``.

Every chunk also carries the token it was sent for, at the top level where OpenAI's SDKs
keep unknown fields (``token_id``, ``logprob``, ``policy_version``): token out. The text
is released as soon as it decodes whole (inference/detokenize.py), less its last
characters, as many as the longest stop string: they could still turn out to be part of
one. When the request offered tools, the text goes through the tool-call parser: the text
around the calls as content, each call as a ``tool_calls`` delta when its block closes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from aiohttp import web

from rtrl.inference.api import RequestBody
from rtrl.inference.chat_messages import Tool
from rtrl.inference.detokenize import IncrementalText
from rtrl.inference.openai_errors import error_body
from rtrl.inference.tool_calls import BangParser, StreamingParser, Text, parser
from rtrl.inference.turns import call_id


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
        holdback: int,
    ) -> None:
        self.response = response
        self._text = IncrementalText(decode)
        self._head = head
        """What every chunk starts with: id, object, created, model, rollout_id."""
        self._chat = head["object"] == "chat.completion.chunk"
        self._holdback = holdback
        self._decoded = ""
        self._role_sent = False
        self._calls: _Calls | None = None
        self.sent = 0
        """Characters of text sent so far (to the tool-call parser, when there is one)."""

    @classmethod
    async def open(
        cls,
        request: web.Request,
        decode: Callable[[Sequence[int]], str],
        head: dict[str, Any],
        body: RequestBody,
    ) -> TokenStream:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        holdback = max((len(s) for s in body.stop_strings()), default=0)
        return cls(response, decode, head, holdback)

    def parse_calls(self, tools: Sequence[Tool], family: str, turn: int, parallel: bool) -> None:
        """Send the tool calls the policy writes (in ``family``'s syntax) as OpenAI's
        ``tool_calls`` deltas (each whole, when it closes), and only the text around them as
        content."""
        names = {t.function.name for t in tools}
        self._calls = _Calls(parser(family, names), self._head["rollout_id"], turn, parallel)

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
        chunk = self._chunk(text[self.sent :], answer["finish_reason"], extra, final=True)
        await self.response.write(event(chunk))
        await self.response.write(b"data: [DONE]\n\n")
        return self.response

    async def fail(self, error: str) -> web.StreamResponse:
        """An error event ends a stream whose status line (200) has already gone, in
        OpenAI's shape: its SDKs raise it as the stream's error."""
        await self.response.write(event(error_body(503, error)))
        return self.response

    def _chunk(
        self, text: str, finish_reason: str | None, extra: dict[str, Any], final: bool = False
    ) -> dict:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self._chat:
            delta: dict[str, Any] = {}
            if self._calls is None:
                delta["content"] = text
            else:
                content, calls = self._calls.feed(text, final)
                if content or not calls:
                    delta["content"] = content
                if calls:
                    delta["tool_calls"] = calls
            if not self._role_sent:  # once, first: OpenAI's SDKs concatenate repeated strings
                delta = {"role": "assistant", **delta}
                self._role_sent = True
            choice["delta"] = delta
        else:
            choice["text"] = text
        return {**self._head, "choices": [choice], **extra}


class _Calls:
    """A turn's text through the tool-call parser, as content and ``tool_calls`` deltas:
    the calls answered (inference/turns.py), with the answer's ids and indices."""

    def __init__(
        self, parser: StreamingParser | BangParser, rollout_id: str, turn: int, parallel: bool
    ) -> None:
        self._parser = parser
        self._parallel = parallel
        self._rollout_id = rollout_id
        self._turn = turn
        self._answered = 0

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        events = self._parser.feed(text) + (self._parser.finish() if final else [])
        content, calls = "", []
        for e in events:
            if isinstance(e, Text):
                content += e.text
            elif e.call.valid and not (self._answered and not self._parallel):
                calls.append(
                    {
                        "index": self._answered,
                        "id": call_id(self._rollout_id, self._turn, e.index),
                        "type": "function",
                        "function": {"name": e.call.name, "arguments": e.call.arguments_json},
                    }
                )
                self._answered += 1
        return content, calls


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"
