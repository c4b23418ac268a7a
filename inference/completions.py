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
import math
import time
from concurrent.futures import Future
from dataclasses import dataclass

import redis.asyncio as aioredis
from aiohttp import web
from opentelemetry import trace
from pydantic import ValidationError

from rtrl import otel
from rtrl.admission import Admission, Refusal
from rtrl.api_keys import ApiKey
from rtrl.chat_template import rendering_for
from rtrl.checkpoint import Checkpoint
from rtrl.inference.access import admit, refused
from rtrl.inference.api import (
    ChatBody,
    FieldRefused,
    Turn,
    chat_response,
    completion_response,
)
from rtrl.inference.asks import Ask, Asks, client_of
from rtrl.inference.config import InferenceSettings
from rtrl.inference.engine import ArmNotReady, Completion, Engine, EngineStopped
from rtrl.inference.openai_errors import error_response, validation_param
from rtrl.inference.recording import (
    InTrajectory,
    KeptFromTraining,
    Private,
    Record,
    Recording,
    RolloutPublisher,
    is_private,
)
from rtrl.inference.records import RolloutContext, rollout_record, trajectory_of
from rtrl.inference.session_state import TrajectoriesFull, TrajectoryConflict
from rtrl.inference.sessions import Sessions
from rtrl.inference.sglang_adapter import SGLangEngine, SGLangGenerationError
from rtrl.inference.streaming import SampledToken, TokenStream
from rtrl.inference.tool_calls import family_of
from rtrl.inference.turns import answered_turn
from rtrl.trajectory import ToolCall

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
    trajectory_turns: int = 0
    """Turns of agents' trajectories (recorded with their links)."""
    dropped: int = 0
    """Streams whose client went away before their last event (an unfinished generation
    aborted)."""

    def count(self, recording: Recording) -> None:
        match recording:
            case Record():
                self.records += 1
            case Private():
                self.private += 1
            case KeptFromTraining():
                self.unrecorded += 1
            case InTrajectory():
                self.trajectory_turns += 1


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
        self.sessions = Sessions(
            settings,
            policy=policy,
            publisher=publisher,
            redis=redis,
            worker_id=worker_id,
            model_name=model_name,
            forget=engine.forget_session,
        )
        template = policy.tokenizer.chat_template
        self.tool_family = family_of(template) if isinstance(template, str) else None
        """The checkpoint's tool-call syntax (None: its turns are text alone)."""
        self.asks = Asks(settings, policy, self.sessions)
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
        # Its chat renders within its client's share of the renderers (rtrl/chat_template.py).
        with self.door.serving(key), rendering_for(client_of(key)):
            return await self._serve(request, span, key)

    async def _admit(self, request: web.Request) -> tuple[ApiKey | None, Refusal | None]:
        return await admit(
            self.door, request.headers.get("Authorization", ""), request.content_length
        )

    async def _serve(
        self, request: web.Request, span: trace.Span, key: ApiKey | None
    ) -> web.StreamResponse:
        """Read and parse the body, then serve it as one turn: a trajectory's turn is a
        transaction (Sessions.turn), released by every path that does not complete it."""
        received, received_ms = time.monotonic(), int(time.time() * 1000)
        raw = await self._read_body(request, key)
        if isinstance(raw, Refusal):
            return refused(raw)
        traceparent = otel.traceparent_of(span) or request.headers.get("traceparent", "")
        try:
            ask = await self.asks.parse(request, raw, received_ms, key, traceparent)
        except ValueError as exc:  # pydantic's ValidationError and FieldRefused are ValueErrors
            self.counters.rejected += 1
            return error_response(400, str(exc), _param_of(exc))
        except TrajectoryConflict as exc:
            self.counters.rejected += 1
            return error_response(409, str(exc), "trajectory_id")
        except TrajectoriesFull as exc:
            retry = {"Retry-After": str(math.ceil(exc.retry_after_s))}
            return error_response(exc.status, str(exc), "trajectory_id", retry)
        async with self.sessions.turn(ask.plan):  # entered with no await since the plan
            return await self._generate(request, span, key, ask, traceparent, received)

    async def _generate(
        self,
        request: web.Request,
        span: trace.Span,
        key: ApiKey | None,
        ask: Ask,
        traceparent: str,
        received: float,
    ) -> web.StreamResponse:
        """Queue the generation, answer it, and whatever ends the request (a client gone
        mid-stream, a failure) settle it before the request leaves the key's budget."""
        if (refusal := self.door.tokens_refusal(key, ask.max_tokens)) is not None:
            return refused(refusal)
        tokens: asyncio.Queue[SampledToken] = asyncio.Queue()
        try:
            generation = self._submit(ask, tokens)
        except ValueError as exc:  # the prompt past the context, bad sampling parameters
            self.counters.rejected += 1
            return error_response(400, str(exc), "messages" if ask.chat else "prompt")
        except UNAVAILABLE as exc:
            return await self._unavailable(exc, None)
        waiting = asyncio.wrap_future(generation)
        try:
            return await self._answer_generated(
                request, span, key, ask, traceparent, received, tokens, waiting
            )
        finally:
            await self._settle(generation, waiting)

    async def _answer_generated(
        self,
        request: web.Request,
        span: trace.Span,
        key: ApiKey | None,
        ask: Ask,
        traceparent: str,
        received: float,
        tokens: asyncio.Queue[SampledToken],
        waiting: asyncio.Future[Completion],
    ) -> web.StreamResponse:
        """Stream or await the completion, decide what is recorded, publish, answer."""
        # Asked while the completion is generated: it decides only what is recorded.
        private_check = asyncio.ensure_future(is_private(self._redis, ask.body, ask.user_id))
        try:
            span.set_attributes({"rtrl.rollout_id": ask.rollout_id, "rtrl.arm": ask.arm})
            stream = None
            if ask.body.stream:
                stream = await self._open_stream(request, ask)
                try:
                    await stream.relay(tokens, waiting)
                except ConnectionResetError:  # the client went away: nobody to answer
                    self.counters.dropped += 1
                    return stream.response
            try:
                completion = await waiting
            except UNAVAILABLE as exc:
                return await self._unavailable(exc, stream)
            turn, calls = self._turn(ask, completion)
            recording = await self._decide(
                ask, traceparent, key, completion, turn, calls, private_check
            )
        finally:
            private_check.cancel()
        if isinstance(recording, Record):
            await self.publisher.publish(ask.rollout_id, recording, key, traceparent)
        self.counters.count(recording)
        answer = self._answer(ask, traceparent, completion, turn, recording, received)
        span.set_attribute(
            "rtrl.policy.versions", [s["version"] for s in answer["policy_versions"]]
        )
        if stream is None:
            return web.json_response(answer)
        try:
            return await stream.finish(answer, completion.result.text)
        except ConnectionResetError:  # gone after the turn was served: it stays served
            self.counters.dropped += 1
            return stream.response

    async def _open_stream(self, request: web.Request, ask: Ask) -> TokenStream:
        """The event stream of a request with ``stream: true``, its status line sent. A
        client gone mid-stream ends its turn unanswered: released (Sessions.turn), its
        generation aborted (``_settle``)."""
        stream = await TokenStream.open(request, self.policy.decode, self._head(ask), ask.body)
        if ask.tools is not None and self.tool_family is not None:
            parallel = isinstance(ask.body, ChatBody) and ask.body.parallel_tool_calls
            stream.parse_calls(ask.tools, self.tool_family, self._turn_index(ask), parallel)
        return stream

    async def _settle(self, generation: Future, waiting: asyncio.Future[Completion]) -> None:
        """A generation nobody will read (its client went away, its request failed) is
        aborted, and waited for until the engine has let go of its row: the request leaves
        the key's in-flight budget only then, so a key dropping its streams never has more
        generations running than its budget."""
        if not generation.done():
            self.engine.abort(generation)
        if waiting.cancelled():  # its waiter was cancelled: wait on the engine's own
            waiting = asyncio.wrap_future(generation)
        await asyncio.wait({waiting})
        if not waiting.cancelled():
            waiting.exception()  # answered already, or nobody is left to answer it

    async def end_trajectory(self, request: web.Request) -> web.Response:
        """``DELETE /v1/trajectories/{trajectory_id}``: the agent is done; its record is
        written now rather than after trajectory_idle_s."""
        key, refusal = await self._admit(request)
        if refusal is not None:
            return refused(refusal)
        trajectory_id = request.match_info["trajectory_id"]
        with self.door.serving(key):
            session = await self.sessions.end(client_of(key), trajectory_id)
        if session is None:
            return error_response(
                404, f"no open trajectory {trajectory_id!r} on this worker", "trajectory_id"
            )
        body = {
            "id": trajectory_id,
            "object": "trajectory",
            "rollout_id": session.opening.rollout_id,
            "links": session.position + 1,
            "turns": session.turns,
            "recorded": not session.private and session.kept is None,
        }
        if session.kept is not None:
            body["not_recorded"] = session.kept.reason
        return web.json_response(body)

    def _head(self, ask: Ask) -> dict:
        return {
            "id": ask.rollout_id,
            "object": "chat.completion.chunk" if ask.chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "rollout_id": ask.rollout_id,
        }

    def _turn_index(self, ask: Ask) -> int:
        return 0 if ask.plan is None else self.sessions.turn_of(ask.plan)

    def _turn(self, ask: Ask, completion: Completion) -> tuple[Turn, tuple[ToolCall, ...]]:
        result = completion.result
        return answered_turn(
            result.text,
            result.finish_reason,
            tools=ask.tools,
            family=self.tool_family,
            parallel=isinstance(ask.body, ChatBody) and ask.body.parallel_tool_calls,
            rollout_id=ask.rollout_id,
            turn=self._turn_index(ask),
        )

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
            session="" if ask.plan is None else self.sessions.engine_session(ask.plan),
        )

    async def _decide(
        self,
        ask: Ask,
        traceparent: str,
        key: ApiKey | None,
        completion: Completion,
        turn: Turn,
        calls: tuple[ToolCall, ...],
        private_check: asyncio.Future[bool],
    ) -> Recording:
        """What is recorded of a generated completion: nothing of a private one; nothing,
        with the reason, of one kept from training or too large to write; else its record.
        An agent's turn joins its trajectory, recorded when the link ends."""
        if ask.plan is not None:
            self.sessions.note(ask.plan, private=await private_check, kept=ask.kept)
            session = ask.plan.session
            ended = self.sessions.complete(
                ask.plan, completion, turn.content, turn.tool_calls, calls, turn.finish_reason
            )
            if ended:
                await self.sessions.end(session.opening.client_id, session.trajectory_id)
            return InTrajectory()
        if await private_check:
            return Private()
        if ask.kept is not None:
            return ask.kept
        body = ask.body
        context = RolloutContext(
            rollout_id=ask.rollout_id,
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
        trajectory = None
        if calls:
            trajectory = trajectory_of(
                completion,
                context.prompt_text,
                final_text=turn.content,
                finish_reason=turn.finish_reason,
                tool_calls=calls,
            )
        return await self.publisher.seal(rollout_record(context, completion, trajectory))

    def _answer(
        self,
        ask: Ask,
        traceparent: str,
        completion: Completion,
        turn: Turn,
        recording: Recording,
        received: float,
    ) -> dict:
        """The answer's body (the final event of a stream)."""
        latency = time.monotonic() - received
        if ask.chat:
            answer = chat_response(ask.rollout_id, self.model_name, completion, latency, turn)
        else:
            answer = completion_response(ask.rollout_id, self.model_name, completion, latency)
        answer["traceparent"] = traceparent
        if isinstance(recording, KeptFromTraining):
            answer["not_recorded"] = recording.reason
        if ask.plan is not None:
            session = ask.plan.session
            answer["trajectory"] = {
                "id": session.trajectory_id,
                "link": session.position,
                "turn": session.turns - 1,
            }
        return answer


def _param_of(exc: ValueError) -> str | None:
    """The request field a 400 is about, as OpenAI names it (None: not one field)."""
    if isinstance(exc, FieldRefused):
        return exc.field
    if isinstance(exc, ValidationError):
        return validation_param(exc)
    return None
