"""``POST /v1/completions`` and ``POST /v1/chat/completions``: one request, step by step.

admit (inference/access.py: the key, from the headers alone) -> read and parse the body
-> generate (streamed as server-sent events when asked) -> decide what is recorded
(inference/recording.py) -> publish the rollout (acked before the answer) -> answer.

Failures are answered narrowly: a body the server refuses is a 400 (a ValueError, naming
the field where it is about one); an arm without weights, a stopping engine or an SGLang
server that fails is a 503 (unavailable: ask again later, or another worker). Anything
else is a bug: it propagates, and aiohttp logs it with its traceback and answers 500.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass

import redis.asyncio as aioredis
from aiohttp import web
from opentelemetry import trace
from pydantic import ValidationError

from rtrl import otel
from rtrl.admission import Admission, Refusal
from rtrl.api_keys import ApiKey
from rtrl.checkpoint import ChatTemplateError, Checkpoint
from rtrl.inference.access import admit, refused
from rtrl.inference.api import (
    ChatBody,
    CompletionBody,
    FieldRefused,
    RequestBody,
    chat_response,
    completion_response,
)
from rtrl.inference.arms import assign_arm
from rtrl.inference.config import InferenceSettings
from rtrl.inference.engine import ArmNotReady, Completion, Engine, EngineStopped
from rtrl.inference.openai_errors import error_response, validation_param
from rtrl.inference.recording import (
    KeptFromTraining,
    Private,
    Record,
    Recording,
    RolloutPublisher,
    is_private,
    kept_from_training,
)
from rtrl.inference.records import RolloutContext, rollout_record
from rtrl.inference.sglang_adapter import SGLangEngine, SGLangGenerationError
from rtrl.inference.streaming import SampledToken, TokenStream

_tracer = trace.get_tracer("rtrl.inference")

UNAVAILABLE = (ArmNotReady, EngineStopped, SGLangGenerationError)
"""What a 503 answers: the worker cannot serve the request now; another, or later, may."""


@dataclass
class RequestCounters:
    """Completion requests by outcome. Produced by CompletionsApi; consumed by the worker's
    heartbeat and its metrics."""

    records: int = 0
    private: int = 0
    rejected: int = 0
    """Answered 400."""
    unavailable: int = 0
    """Answered 503."""
    unrecorded: int = 0
    """Served but kept from training (recording.KeptFromTraining)."""

    def count(self, recording: Recording) -> None:
        match recording:
            case Record():
                self.records += 1
            case Private():
                self.private += 1
            case KeptFromTraining():
                self.unrecorded += 1


@dataclass(frozen=True)
class Ask:
    """A request's body, checked, with the server's defaults filled in and the arm assigned."""

    body: RequestBody
    chat: bool
    prompt_ids: list[int]
    max_tokens: int
    user_id: str
    """The end user (RequestBody.end_user)."""
    arm: str
    temperature: float
    top_p: float
    client_ts_ms: int
    """The body's, or the server's clock when it arrived."""
    kept: KeptFromTraining | None
    """Why its completion will not be recorded, when that is known before it is generated."""


class CompletionsApi:
    """The two completion routes over one engine, for one worker."""

    def __init__(
        self,
        settings: InferenceSettings,
        *,
        worker_id: str,
        model_name: str,
        policy: Checkpoint,
        engine: Engine | SGLangEngine,
        door: Admission,
        publisher: RolloutPublisher,
        redis: aioredis.Redis,
    ) -> None:
        self.settings = settings
        self.worker_id = worker_id
        self.model_name = model_name
        self.policy = policy
        """What the worker serves: its tokenizer, chat template and architecture."""
        self.engine = engine
        self.door = door
        self.publisher = publisher
        self._redis = redis
        self._client_ts_window = settings.client_ts_window()
        self._created = int(time.time())
        self.counters = RequestCounters()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """The serving span is the root of the rollout's trace (or a child of the
        client's ``traceparent``); the record and the answer carry its traceparent, so
        the client's events and the reward continue the trace."""
        attributes = {
            "http.request.method": "POST",
            "url.path": request.path,
            "rtrl.worker_id": self.worker_id,
        }
        with _tracer.start_as_current_span(
            f"POST {request.path}",
            context=otel.parent(request.headers.get("traceparent", "")),
            kind=trace.SpanKind.SERVER,
            attributes=attributes,
        ) as span:
            response = await self._admitted(request, span)
            span.set_attribute("http.response.status_code", response.status)
            return response

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models`` (and ``/v1/models/{model}``): the policy this worker serves,
        behind the same door as its completions. A request may name any model: it is
        served by this one."""
        key, refusal = await self._admit(request)
        if refusal is not None:
            return refused(refusal)
        with self.door.serving(key):
            model = {
                "id": self.model_name,
                "object": "model",
                "created": self._created,
                "owned_by": "rtrl",
            }
            asked = request.match_info.get("model")
            if asked is None:
                return web.json_response({"object": "list", "data": [model]})
            if asked != self.model_name:
                return error_response(404, f"this worker serves {self.model_name!r}", "model")
            return web.json_response(model)

    async def _admitted(self, request: web.Request, span: trace.Span) -> web.StreamResponse:
        """Who is asking is settled from the headers, before the body is read."""
        key, refusal = await self._admit(request)
        if refusal is not None:
            return refused(refusal)
        if key is not None:
            span.set_attribute("rtrl.client_id", key.client_id)
        with self.door.serving(key):
            return await self._serve(request, span, key)

    async def _admit(self, request: web.Request) -> tuple[ApiKey | None, Refusal | None]:
        return await admit(
            self.door, request.headers.get("Authorization", ""), request.content_length
        )

    async def _serve(
        self, request: web.Request, span: trace.Span, key: ApiKey | None
    ) -> web.StreamResponse:
        """Read and parse the body, generate, decide what is recorded, publish, answer."""
        received, received_ms = time.monotonic(), int(time.time() * 1000)
        raw = await self._read_body(request, key)
        if isinstance(raw, Refusal):
            return refused(raw)
        tokens: asyncio.Queue[SampledToken] = asyncio.Queue()
        try:
            ask = await self._parse(request.path, raw, received_ms, key)
            if (refusal := self.door.tokens_refusal(key, ask.max_tokens)) is not None:
                return refused(refusal)
            waiting = asyncio.wrap_future(self._submit(ask, tokens))
        except ValueError as exc:  # pydantic's ValidationError and FieldRefused are ValueErrors
            self.counters.rejected += 1
            return error_response(400, str(exc), _param_of(exc))
        except UNAVAILABLE as exc:
            return await self._unavailable(exc, None)
        # Asked while the completion is generated: it decides only what is recorded.
        private_check = asyncio.ensure_future(is_private(self._redis, ask.body, ask.user_id))
        rollout_id = str(uuid.uuid4())
        traceparent = otel.traceparent_of(span) or request.headers.get("traceparent", "")
        span.set_attributes({"rtrl.rollout_id": rollout_id, "rtrl.arm": ask.arm})
        stream = None
        if ask.body.stream:
            stream = await TokenStream.open(
                request,
                self.policy.decode,
                rollout_id,
                self.model_name,
                ask.chat,
                ask.body.stop_strings(),
            )
            await stream.relay(tokens, waiting)
        try:
            completion = await waiting
        except UNAVAILABLE as exc:
            private_check.cancel()
            return await self._unavailable(exc, stream)
        recording = await self._decide(ask, rollout_id, traceparent, key, completion, private_check)
        if isinstance(recording, Record):
            await self.publisher.publish(rollout_id, recording, key, traceparent)
        self.counters.count(recording)
        answer = self._answer(ask, rollout_id, traceparent, completion, recording, received)
        span.set_attribute(
            "rtrl.policy.versions", [s["version"] for s in answer["policy_versions"]]
        )
        if stream is None:
            return web.json_response(answer)
        return await stream.finish(answer, completion.result.text)

    async def _unavailable(self, exc: Exception, stream: TokenStream | None) -> web.StreamResponse:
        """503, or an error event on a stream whose 200 has already gone."""
        self.counters.unavailable += 1
        if stream is not None:
            return await stream.fail(str(exc))
        return error_response(503, str(exc))

    async def _read_body(self, request: web.Request, key: ApiKey | None) -> bytes | Refusal:
        """The whole body, read no further than this request may send (a chunked body has no
        Content-Length to refuse it by)."""
        limit = self.door.body_limit(key) or self.settings.max_request_bytes
        raw = bytearray()
        while chunk := await request.content.read(limit + 1 - len(raw)):
            raw += chunk
            if len(raw) > limit:
                refusal = self.door.size_refusal(key, len(raw))
                assert refusal is not None  # over the limit the door itself gave
                return refusal
        return bytes(raw)

    async def _parse(self, path: str, raw: bytes, received_ms: int, key: ApiKey | None) -> Ask:
        """The request as the engine will run it. Raises ValueError (pydantic's
        ValidationError, FieldRefused naming the field) for a body the server refuses."""
        chat = path.endswith("/chat/completions")
        body: RequestBody = (ChatBody if chat else CompletionBody).model_validate_json(raw)
        user_id = body.end_user(key.client_id if key is not None else None)
        prompt_ids = await self._prompt_ids(body)
        body.check_client_ts(received_ms, self._client_ts_window)
        s = self.settings
        temperature = s.temperature if body.temperature is None else body.temperature
        top_p = body.top_p or s.top_p
        return Ask(
            body=body,
            chat=chat,
            prompt_ids=prompt_ids,
            max_tokens=body.max_tokens or s.max_tokens,
            user_id=user_id,
            arm=body.arm or assign_arm(user_id, s.treatment_fraction),
            temperature=temperature,
            top_p=top_p,
            client_ts_ms=received_ms if body.client_ts_ms is None else body.client_ts_ms,
            kept=kept_from_training(s, body, temperature, top_p),
        )

    async def _prompt_ids(self, body: RequestBody) -> list[int]:
        """The token ids the model sees: the chat template's rendering of the messages, the
        prompt's tokens, or the prompt's ids as given (checked against the vocabulary).
        Raises FieldRefused naming the field. The template renders in a thread, within its
        bounds (rtrl/chat_template.py): the event loop goes on serving meanwhile."""
        if isinstance(body, ChatBody):
            messages = [m.model_dump() for m in body.messages]
            try:
                return await asyncio.to_thread(self.policy.render_chat, messages)
            except ChatTemplateError as exc:
                raise FieldRefused("messages", str(exc)) from None
        assert isinstance(body, CompletionBody)
        if isinstance(body.prompt, list):
            vocab = self.policy.spec.vocab_size
            if any(i >= vocab for i in body.prompt):
                raise FieldRefused("prompt", f"token ids must be below the vocabulary's {vocab}")
            return list(body.prompt)
        try:
            return self.policy.encode(body.prompt)
        except ValueError as exc:
            raise FieldRefused("prompt", str(exc)) from None

    def _submit(self, ask: Ask, tokens: asyncio.Queue[SampledToken]) -> Future:
        """Queue the completion on the engine; a streamed one puts each token on ``tokens``
        as it is sampled (from the engine's thread)."""
        loop = asyncio.get_running_loop()

        def stream_token(token_id: int, logprob: float, version: int) -> None:
            loop.call_soon_threadsafe(tokens.put_nowait, SampledToken(token_id, logprob, version))

        return self.engine.submit(
            ask.arm,
            ask.prompt_ids,
            max_tokens=ask.max_tokens,
            temperature=ask.temperature,
            top_p=ask.top_p,
            seed=ask.body.seed,
            stop=ask.body.stop_strings(),
            on_token=stream_token if ask.body.stream else None,
        )

    async def _decide(
        self,
        ask: Ask,
        rollout_id: str,
        traceparent: str,
        key: ApiKey | None,
        completion: Completion,
        private_check: asyncio.Future[bool],
    ) -> Recording:
        """What is recorded of a generated completion: nothing of a private one; nothing,
        with the reason, of one kept from training or too large to write; else its record."""
        if await private_check:
            return Private()
        if ask.kept is not None:
            return ask.kept
        body = ask.body
        context = RolloutContext(
            rollout_id=rollout_id,
            session_id=body.session_id,
            user_id=ask.user_id,
            client_ts_ms=ask.client_ts_ms,
            worker_id=self.worker_id,
            model_name=self.model_name,
            prompt_text=self.policy.decode(ask.prompt_ids),
            prompt_group_id=body.prompt_group_id,
            context_key=body.context_key,
            traceparent=traceparent,
            client_id=key.client_id if key is not None else "",
        )
        value = rollout_record(context, completion).SerializeToString()
        return self.publisher.fits(rollout_id, value)

    def _answer(
        self,
        ask: Ask,
        rollout_id: str,
        traceparent: str,
        completion: Completion,
        recording: Recording,
        received: float,
    ) -> dict:
        """The answer's body (the final event of a stream)."""
        respond = chat_response if ask.chat else completion_response
        answer = {
            **respond(rollout_id, self.model_name, completion, time.monotonic() - received),
            "traceparent": traceparent,
        }
        if isinstance(recording, KeptFromTraining):
            answer["not_recorded"] = recording.reason
        return answer


def _param_of(exc: ValueError) -> str | None:
    """The request field a 400 is about, as OpenAI names it (None: not one field)."""
    if isinstance(exc, FieldRefused):
        return exc.field
    if isinstance(exc, ValidationError):
        return validation_param(exc)
    return None
