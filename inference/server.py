"""The inference process: the HTTP API over one Engine, weight followers, heartbeat.

``POST /v1/completions`` (a prompt) and ``POST /v1/chat/completions`` (messages, rendered
by the checkpoint's chat template) answer only after the completion's RolloutRecord was acked
by the broker (so a product event can never refer to an unknown rollout); requests in
privacy mode, or from a user registered as private, produce no record. It takes an API
key of scope ``completions`` (inference/access.py) and remembers which client each
rollout was served to. Answers:
  200  the completion
  400  the body is not a valid request, e.g. a ``client_ts_ms`` outside the window of
       InferenceSettings around the worker's clock, text outside the model's vocabulary,
       or messages the chat template refuses (``{"error": ..., "field": ...}``)
  401  no usable API key; 403 a key without the ``completions`` scope
  413  a body over the server's bound; 429 over the key's budgets (rate, in flight,
       request size, tokens), with Retry-After where waiting helps
  503  the arm has no weights yet (after ``ready_timeout_s``) or the engine stopped
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass

import redis.asyncio as aioredis
from aiohttp import web
from opentelemetry import metrics, trace
from opentelemetry.util.types import AttributeValue
from pydantic import ValidationError

from rtrl import heartbeat, kafka, otel, signing, topics
from rtrl.api_keys import (
    PRIVATE_USERS,
    SERVED_PREFIX,
    ApiKey,
    KeyCache,
    KeyVerifier,
    RateLimiter,
)
from rtrl.checkpoint import ChatTemplateError, Checkpoint
from rtrl.config import StackSettings
from rtrl.inference.access import Denied, ServingDoor
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
from rtrl.inference.engine import ARMS, ArmNotReady, Engine, EngineConfig
from rtrl.inference.records import RolloutContext, rollout_record
from rtrl.inference.sglang_adapter import ServedModel, SGLangEngine
from rtrl.inference.weights import WeightFollower
from rtrl.runtime import until_stopped

log = logging.getLogger("inference")
_tracer = trace.get_tracer("rtrl.inference")

SERVICE = "inference"
APPLIED_KEY = "rtrl:applied:{arm}:{version}"


@dataclass
class RequestCounters:
    records: int = 0
    private: int = 0
    rejected: int = 0
    unavailable: int = 0
    unrecorded: int = 0
    """Served but kept from training: an arm the caller chose, or sampling outside the trained band."""


class InferenceServer:
    """A started worker; ``stop()`` drains it."""

    def __init__(
        self, stack: StackSettings, settings: InferenceSettings, engine: Engine | None = None
    ) -> None:
        """``engine`` replaces the one built from ``settings`` (tests attach hooks to it)."""
        self.stack = stack
        self.settings = settings
        self.worker_id = f"inference-{stack.instance}"
        self.policy = (
            Checkpoint.builtin_demo()
            if stack.model_dir is None
            else Checkpoint.open(stack.model_dir)
        )
        """What the worker serves: its tokenizer, chat template and architecture."""
        self.model_name = settings.model_name or (
            stack.model_dir.name if stack.model_dir is not None else "rtrl-demo-policy"
        )
        key = settings.rollout_signing_key.get_secret_value()
        if not key:
            raise ValueError(
                "RTRL_INFERENCE_ROLLOUT_SIGNING_KEY is not set: every rollout is signed, and there is no default key"
            )
        self.rollout_signer = signing.Signer(key, signing.Purpose.ROLLOUT)
        if settings.auth_required and not stack.api_key_public_keys.strip():
            raise ValueError(
                "RTRL_API_KEY_PUBLIC_KEYS is not set: the serving API accepts only API keys the operator signed"
            )
        self.door: ServingDoor | None = None
        self.engine = engine or _engine(settings, self.policy)
        self.engine.on_applied = self._applied_from_engine_thread
        self.counters = RequestCounters()
        self.port = settings.http_port
        self.client_ts_window = settings.client_ts_window()
        self._background: set[asyncio.Task] = set()
        self._followers: list[WeightFollower] = []

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(kafka.wait_for_broker, self.stack)
        self.redis = aioredis.Redis.from_url(self.stack.redis_url)
        if self.settings.auth_required:
            verifier = KeyVerifier(signing.parse_public_keys(self.stack.api_key_public_keys))
            self.door = ServingDoor(
                KeyCache(self.redis, self.settings.key_cache_ttl_s, verifier),
                RateLimiter(self.redis),
                self.settings.max_request_bytes,
            )
        else:
            log.warning(
                "RTRL_INFERENCE_AUTH_REQUIRED=false: serving completions without an API key"
            )
        self.producer = kafka.AsyncProducer(
            self.stack, **{"message.timeout.ms": self.settings.produce_timeout_ms}
        )
        self.engine.start()
        # SGLang gets its weights from its sidecar; only the embedded engine follows them here.
        if self.settings.follow_weights and self.settings.backend == "embedded":
            engine = self.engine
            assert isinstance(engine, Engine)  # what the embedded backend runs
            self._followers = [
                WeightFollower(
                    functools.partial(engine.stage, arm),
                    self.stack.weight_sync_addr,
                    self.stack.weight_sync_subscribe_token.get_secret_value(),
                    arm,
                    self.worker_id,
                    public_keys=signing.parse_public_keys(self.stack.manifest_public_keys),
                    tls_ca_file=self.stack.weight_sync_tls_ca_file,
                ).start()
                for arm in ARMS
            ]
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_get("/healthz", self._healthz)
        self.runner = web.AppRunner(
            app, access_log=None, shutdown_timeout=self.settings.shutdown_grace_s
        )
        await self.runner.setup()
        await web.TCPSite(
            self.runner,
            self.settings.bind_host,
            self.settings.http_port,
            ssl_context=self.settings.http_context(),
        ).start()
        self.port = self.runner.addresses[0][1]
        self._observe()
        self.heartbeat_task = asyncio.create_task(self._beat_forever())
        log.info("%s listening on http://%s:%d", self.worker_id, self.settings.bind_host, self.port)

    async def stop(self) -> None:
        # Stop taking requests, let in-flight ones finish (the engine still runs), then
        # stop the weight feed and the engine, and flush the last rollout records.
        await self.runner.cleanup()
        self.heartbeat_task.cancel()
        await asyncio.gather(self.heartbeat_task, return_exceptions=True)
        for follower in self._followers:
            await asyncio.to_thread(follower.stop)
        await asyncio.to_thread(self.engine.stop)
        self.engine.on_applied = None
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        undelivered = await asyncio.to_thread(self.producer.close)
        if undelivered:
            log.warning("%d rollout records were still undelivered at shutdown", undelivered)
        # librdkafka holds its broker connections until the client object is freed.
        del self.producer
        await self.redis.aclose()

    def status(self) -> heartbeat.InferenceBeat:
        stats = self.engine.stats
        return heartbeat.InferenceBeat(
            ready=self.engine.ready(),
            versions=self.engine.versions(),
            weights_digests=self.engine.digests(),
            http_port=self.port,
            worker_id=self.worker_id,
            completions=stats.completions,
            tokens=stats.tokens,
            swaps=stats.swaps,
            batches=stats.batches,
            queue_depth=self.engine.queue_depth(),
            rollout_records=self.counters.records,
            private_completions=self.counters.private,
            rejected=self.counters.rejected,
            unavailable=self.counters.unavailable,
            unrecorded=self.counters.unrecorded,
            weights_refused=sum(follower.refused for follower in self._followers),
        )

    def _observe(self) -> None:
        """The engine's and the API's counters as OpenTelemetry (and so Prometheus) metrics."""
        meter = metrics.get_meter("rtrl.inference")
        stats, counters = self.engine.stats, self.counters
        for name, unit, description in (
            ("completions", "{completion}", "Completions finished"),
            ("tokens", "{token}", "Tokens sampled"),
            ("swaps", "{swap}", "Weight versions swapped in"),
        ):
            otel.observe(
                meter,
                f"rtrl.inference.{name}",
                "counter",
                _reading(stats, name),
                unit=unit,
                description=description,
            )
        otel.observe(
            meter,
            "rtrl.inference.swap.pause",
            "counter",
            lambda: [(stats.swap_pause_s, {})],
            unit="s",
            description="Time decoding stood still for weight swaps",
        )
        otel.observe(
            meter,
            "rtrl.inference.requests",
            "counter",
            lambda: [
                (counters.records, {"outcome": "recorded"}),
                (counters.private, {"outcome": "private"}),
                (counters.rejected, {"outcome": "rejected"}),
                (counters.unavailable, {"outcome": "unavailable"}),
                (counters.unrecorded, {"outcome": "unrecorded"}),
            ],
            unit="{request}",
            description="Completion requests by outcome "
            "(rejected: 400, unavailable: 503, unrecorded: served, kept from training)",
        )
        otel.observe(
            meter,
            "rtrl.inference.policy.version",
            "gauge",
            lambda: [(v, {"arm": arm}) for arm, v in self.engine.versions().items()],
            description="Policy version each arm serves (-1: none yet)",
        )
        otel.observe(
            meter,
            "rtrl.inference.queue_depth",
            "gauge",
            lambda: [(self.engine.queue_depth(), {})],
            unit="{request}",
            description="Requests waiting for the engine",
        )
        otel.observe(
            meter,
            "rtrl.inference.weights.refused",
            "counter",
            lambda: [(sum(f.refused for f in self._followers), {})],
            unit="{version}",
            description="Weight versions refused because the trainer did not sign their manifest",
        )

    async def _beat_forever(self) -> None:
        while True:
            if self.engine.failure is not None:
                raise RuntimeError("the inference engine crashed") from self.engine.failure
            await heartbeat.beat(self.redis, SERVICE, self.stack.instance, self.status())
            await asyncio.sleep(self.settings.heartbeat_interval_s)

    def _applied_from_engine_thread(self, arm: str, version: int) -> None:
        self._loop.call_soon_threadsafe(self._record_applied, arm, version, time.time_ns())

    def _record_applied(self, arm: str, version: int, applied_ns: int) -> None:
        log.info("%s serving %s v%d", self.worker_id, arm, version)
        self._trace_apply(arm, version, applied_ns)
        applied_ms = applied_ns // 1_000_000
        task = asyncio.create_task(self._write_applied(arm, version, applied_ms))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _write_applied(self, arm: str, version: int, applied_ms: int) -> None:
        await self.redis.hset(
            APPLIED_KEY.format(arm=arm, version=version), self.worker_id, applied_ms
        )

    def _trace_apply(self, arm: str, version: int, applied_ns: int) -> None:
        """The ``weights apply`` span: from the version staged to it serving, a child
        of the weight_sync commit (through the manifest's traceparent)."""
        staged = next(
            (found for f in self._followers if f.arm == arm and (found := f.staged(version))), None
        )
        if (
            staged is None
        ):  # not staged by this process (a test's engine, or SGLang's sidecar, which traces its own)
            return
        traceparent, staged_ns = staged
        attributes: dict[str, AttributeValue] = {
            "rtrl.arm": arm,
            "rtrl.policy.version": version,
            "rtrl.worker_id": self.worker_id,
        }
        span = _tracer.start_span(
            "weights apply",
            context=otel.parent(traceparent),
            attributes=attributes,
            start_time=staged_ns,
        )
        span.end(end_time=applied_ns)

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "ready": self.engine.ready(),
                "versions": self.engine.versions(),
                "worker_id": self.worker_id,
            }
        )

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        """The serving span is the root of the rollout's trace (or a child of the
        client's ``traceparent``); the record and the answer carry its traceparent, so
        the client's events and the reward continue the trace."""
        attributes = {
            "http.request.method": "POST",
            "url.path": request.path,
            "rtrl.worker_id": self.worker_id,
        }
        parent = otel.parent(request.headers.get("traceparent", ""))
        with _tracer.start_as_current_span(
            f"POST {request.path}",
            context=parent,
            kind=trace.SpanKind.SERVER,
            attributes=attributes,
        ) as span:
            response = await self._complete(request, span)
            span.set_attribute("http.response.status_code", response.status)
            return response

    def _kept_from_training(self, body: RequestBody, temperature: float, top_p: float) -> str:
        """Why this completion is served but not recorded as a rollout ("" if it is recorded).
        The server decides what the trainer learns from: the arm is the server's to assign
        (a caller that picks one would also pick what trains it), and sampling must be the
        policy's own, within the trained band."""
        s = self.settings
        if body.arm is not None:
            return "the caller chose the arm"
        if not s.trained_temperature_min <= temperature <= s.trained_temperature_max:
            return (
                f"temperature {temperature:g} is outside the trained band "
                f"[{s.trained_temperature_min:g}, {s.trained_temperature_max:g}]"
            )
        if top_p < s.trained_top_p_min:
            return f"top_p {top_p:g} is below the trained band's {s.trained_top_p_min:g}"
        return ""

    def _too_large(self, rollout_id: str, value: bytes) -> str:
        """Why a rollout record is too large to write ("" if it is not): the reward built on
        it carries it, and must fit the broker's record limit too."""
        limit = kafka.max_rollout_bytes(self.stack.kafka_max_record_bytes)
        if len(value) <= limit:
            return ""
        log.warning(
            "rollout %s served but not recorded: %d bytes, over %d", rollout_id, len(value), limit
        )
        return (
            f"its rollout record is {len(value):,} bytes, over the {limit:,} that leave room "
            f"for the reward carrying it (RTRL_KAFKA_MAX_RECORD_BYTES)"
        )

    async def _complete(self, request: web.Request, span: trace.Span) -> web.StreamResponse:
        """Who is asking is settled from the headers, before the body is read."""
        key = None
        if self.door is not None:
            key, denied = await self.door.admit(
                request.headers.get("Authorization", ""), request.content_length
            )
            if denied is not None:
                return _denied(denied)
            assert key is not None  # admitted: its key was verified
            span.set_attribute("rtrl.client_id", key.client_id)
        with self.door.serving(key) if self.door is not None else contextlib.nullcontext():
            return await self._serve(request, span, key)

    async def _read_body(self, request: web.Request, key: ApiKey | None) -> bytes | Denied:
        """The whole body, read no further than this request may send (a chunked body has no
        Content-Length to refuse it by)."""
        limit = (
            self.door.body_limit(key) if self.door is not None else self.settings.max_request_bytes
        )
        raw = bytearray()
        while chunk := await request.content.read(limit + 1 - len(raw)):
            raw += chunk
            if len(raw) > limit:
                return (
                    self.door.too_large(key, len(raw))
                    if self.door is not None
                    else Denied(413, f"a request over {limit} bytes")
                )
        return bytes(raw)

    def _prompt_ids(self, body: RequestBody) -> list[int]:
        """The token ids the model sees: the chat template's rendering of the messages, the
        prompt's tokens, or the prompt's ids as given (checked against the vocabulary).
        Raises FieldRefused naming the field."""
        if isinstance(body, ChatBody):
            try:
                return self.policy.render_chat([m.model_dump() for m in body.messages])
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

    async def _private(self, body: RequestBody) -> bool:
        """One privacy policy at every door: the request's flag, or the user registered as
        private (the same set the ingest gateway reads)."""
        return body.privacy_mode or bool(
            body.user_id and await self.redis.sismember(PRIVATE_USERS, body.user_id)
        )

    async def _serve(
        self, request: web.Request, span: trace.Span, key: ApiKey | None
    ) -> web.StreamResponse:
        received = time.monotonic()
        received_ms = int(time.time() * 1000)
        tokens: asyncio.Queue[tuple[int, float, int]] = asyncio.Queue()
        raw = await self._read_body(request, key)
        if isinstance(raw, Denied):
            return _denied(raw)
        try:
            chat = request.path.endswith("/chat/completions")
            body: RequestBody = (ChatBody if chat else CompletionBody).model_validate_json(raw)
            prompt_ids = self._prompt_ids(body)
            body.check_client_ts(received_ms, self.client_ts_window)
            max_tokens = body.max_tokens or self.settings.max_tokens
            if (
                self.door is not None
                and (denied := self.door.tokens_denied(key, max_tokens)) is not None
            ):
                return _denied(denied)
            arm = body.arm or assign_arm(body.user_id, self.settings.treatment_fraction)
            temperature = (
                self.settings.temperature if body.temperature is None else body.temperature
            )
            top_p = body.top_p or self.settings.top_p
            unrecorded = self._kept_from_training(body, temperature, top_p)

            def stream_token(token_id: int, logprob: float, version: int) -> None:
                self._loop.call_soon_threadsafe(tokens.put_nowait, (token_id, logprob, version))

            future = self.engine.submit(
                arm,
                prompt_ids,
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                seed=body.seed,
                stop=body.stop_strings(),
                on_token=stream_token if body.stream else None,
            )
        except (ValidationError, ValueError) as exc:
            self.counters.rejected += 1
            return web.json_response({"error": str(exc), "field": _field_of(exc)}, status=400)
        except RuntimeError as exc:
            self.counters.unavailable += 1
            return web.json_response({"error": str(exc)}, status=503)
        # Asked while the completion is generated: it decides only what is recorded.
        private_check = asyncio.ensure_future(self._private(body))
        rollout_id = str(uuid.uuid4())
        traceparent = otel.traceparent_of(span) or request.headers.get("traceparent", "")
        span.set_attributes({"rtrl.rollout_id": rollout_id, "rtrl.arm": arm})
        waiting = asyncio.wrap_future(future)
        stream, streamed = None, 0
        if body.stream:
            stream, streamed = await self._stream_tokens(request, rollout_id, body, tokens, waiting)
        try:
            completion = await waiting
        except (ArmNotReady, RuntimeError) as exc:
            self.counters.unavailable += 1
            private_check.cancel()
            if stream is not None:
                await stream.write(_event({"error": str(exc)}))
                return stream
            return web.json_response({"error": str(exc)}, status=503)
        private = await private_check
        if private:
            self.counters.private += 1
        elif not unrecorded:
            context = RolloutContext(
                rollout_id=rollout_id,
                session_id=body.session_id,
                user_id=body.user_id,
                client_ts_ms=received_ms if body.client_ts_ms is None else body.client_ts_ms,
                worker_id=self.worker_id,
                model_name=self.model_name,
                prompt_text=self.policy.decode(prompt_ids),
                prompt_group_id=body.prompt_group_id,
                context_key=body.context_key,
                traceparent=traceparent,
                client_id=key.client_id if key is not None else "",
            )
            value = rollout_record(context, completion).SerializeToString()
            unrecorded = self._too_large(rollout_id, value)
        if unrecorded and not private:
            self.counters.unrecorded += 1
        elif not private:
            if key is not None:
                # Before the answer: the client's telemetry about it may arrive right after.
                await self.redis.set(
                    SERVED_PREFIX + rollout_id, key.client_id, ex=self.settings.served_ttl_s
                )
            publish = otel.kafka_attributes("publish", topics.ROLLOUT, key=rollout_id)
            with _tracer.start_as_current_span(
                f"publish {topics.ROLLOUT}", kind=trace.SpanKind.PRODUCER, attributes=publish
            ) as producing:
                headers = [
                    *kafka.traceparent_headers(otel.traceparent_of(producing) or traceparent),
                    *self.rollout_signer.headers(value),
                ]
                await self.producer.send(topics.ROLLOUT, value, key=rollout_id, headers=headers)
            self.counters.records += 1
        answer = {
            **(chat_response if chat else completion_response)(
                rollout_id, self.model_name, completion, time.monotonic() - received
            ),
            "traceparent": traceparent,
        }
        if unrecorded:
            answer["not_recorded"] = unrecorded  # the product need not report telemetry for it
        span.set_attribute(
            "rtrl.policy.versions", [s["version"] for s in answer["policy_versions"]]
        )
        if stream is None:
            return web.json_response(answer)
        # The text streamed so far stops short of any stop string; the rest comes here.
        await stream.write(_event({**answer, "delta": completion.result.text[streamed:]}))
        await stream.write(b"data: [DONE]\n\n")
        return stream

    async def _stream_tokens(
        self,
        request: web.Request,
        rollout_id: str,
        body: RequestBody,
        tokens: asyncio.Queue,
        waiting: asyncio.Future,
    ) -> tuple[web.StreamResponse, int]:
        """Send a server-sent event per token until the completion is done; returns the
        response and how many characters of text it sent. The last characters, as many
        as the longest stop string, are held back: they could still turn out to be part
        of one (the final event sends what remains of the answer's text)."""
        stream = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await stream.prepare(request)
        holdback = max((len(s) for s in body.stop_strings()), default=0)
        ids: list[int] = []
        text, sent = "", 0
        while not (waiting.done() and tokens.empty()):
            getter = asyncio.ensure_future(tokens.get())
            await asyncio.wait({getter, waiting}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                continue
            token, logprob, version = getter.result()
            ids.append(token)
            # Decoded whole each time: a byte-level token may be half of a character.
            text = self.policy.decode(ids)
            delta = text[sent : max(sent, len(text) - holdback)]
            sent += len(delta)
            await stream.write(
                _event(
                    {
                        "rollout_id": rollout_id,
                        "token_id": token,
                        "logprob": logprob,
                        "policy_version": version,
                        "delta": delta,
                    }
                )
            )
        return stream, sent


def _engine(settings: InferenceSettings, policy: Checkpoint) -> Engine | SGLangEngine:
    if settings.backend == "sglang":
        return SGLangEngine(
            settings.sglang_url_map(),
            model=ServedModel.of(policy),
            max_concurrency=settings.sglang_max_concurrency,
            timeout_s=settings.sglang_timeout_s,
            api_key=settings.sglang_api_key.get_secret_value(),
        )
    return Engine(
        EngineConfig(
            max_batch=settings.max_batch,
            batch_wait_s=settings.batch_wait_ms / 1000,
            swap_policy=settings.swap_policy,
            ready_timeout_s=settings.ready_timeout_s,
            hf_config=policy.config,
            decode=policy.decode,
        )
    )


def _reading(stats: object, name: str) -> otel.Reading:
    """The metric reading of ``stats.<name>``, taken at every collection."""
    return lambda: [(getattr(stats, name), {})]


def _denied(denied: Denied) -> web.Response:
    headers = (
        {"Retry-After": str(max(1, math.ceil(denied.retry_after_s)))}
        if denied.retry_after_s
        else None
    )
    return web.json_response({"error": denied.message}, status=denied.status, headers=headers)


def _field_of(exc: ValueError) -> str:
    """The request field a 400 is about ("" when it is not about one field)."""
    if isinstance(exc, FieldRefused):
        return exc.field
    if isinstance(exc, ValidationError) and exc.errors():
        return ".".join(str(part) for part in exc.errors()[0]["loc"])
    return ""


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


async def serve(stack: StackSettings, settings: InferenceSettings) -> None:
    """Run until SIGTERM or SIGINT (or until the engine or the heartbeat dies), then drain."""
    server = InferenceServer(stack, settings)
    await server.start()
    try:
        await until_stopped(server.heartbeat_task)
    finally:
        await server.stop()
