"""The inference process: the HTTP API over one Engine, weight followers, heartbeat.

``POST /v1/completions`` (a prompt) and ``POST /v1/chat/completions`` (messages, rendered
by the checkpoint's chat template) answer only after the completion's RolloutRecord was acked
by the broker (so a product event can never refer to an unknown rollout); requests in
privacy mode, or from a user registered as private, produce no record. It takes an API
key of scope ``completions`` (inference/access.py) and remembers which client each
rollout was served to. The request path is inference/completions.py. Answers:
  200  the completion
  400  the body is not a valid request, e.g. a ``client_ts_ms`` outside the window of
       InferenceSettings around the worker's clock, text outside the model's vocabulary,
       or messages the chat template refuses (``{"error": ..., "field": ...}``)
  401  no usable API key; 403 a key without the ``completions`` scope
  413  a body over the server's bound; 429 over the key's budgets (rate, in flight,
       request size, tokens), with Retry-After where waiting helps
  409  a trajectory's turn it cannot take (one mid-turn, one lost or ended for room);
       429 also for a client holding its share of open trajectories, all mid-turn
  503  the arm has no weights yet (after ``ready_timeout_s``), the engine stopped, an
       SGLang server failed, or the worker holds its bound of trajectories, none of the
       client's own idle (inference/sessions.py)
  500  a bug (the engine crashed, or anything unforeseen): logged with its traceback
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
from aiohttp import web

from rtrl import bulk, heartbeat, kafka, signing
from rtrl.admission import Admission
from rtrl.checkpoint import Checkpoint
from rtrl.config import StackSettings
from rtrl.http_limits import serve_http
from rtrl.inference.access import serving_door
from rtrl.inference.applied import AppliedVersions
from rtrl.inference.completions import CompletionsApi, RequestCounters
from rtrl.inference.config import InferenceSettings
from rtrl.inference.engine import ARMS, Engine, EngineConfig
from rtrl.inference.metrics import observe
from rtrl.inference.recording import RolloutPublisher
from rtrl.inference.sglang_adapter import ServedModel, SGLangEngine
from rtrl.inference.weights import WeightFollower
from rtrl.runtime import bounded, until_stopped

log = logging.getLogger("inference")

SERVICE = "inference"


@dataclass
class InferenceServer:
    """A started worker, built whole by ``start()``; ``stop()`` drains it."""

    stack: StackSettings
    settings: InferenceSettings
    worker_id: str
    engine: Engine | SGLangEngine
    api: CompletionsApi
    followers: list[WeightFollower]
    """One per arm, feeding the embedded engine from weight_sync (none for SGLang)."""
    applied: AppliedVersions
    producer: kafka.AsyncProducer
    redis: aioredis.Redis
    runner: web.AppRunner
    port: int
    heartbeat_task: asyncio.Task
    sweeper: asyncio.Task
    """Ends agents' idle trajectories (inference/sessions.py)."""

    @property
    def door(self) -> Admission:
        return self.api.door

    @property
    def counters(self) -> RequestCounters:
        return self.api.counters

    def status(self) -> heartbeat.InferenceBeat:
        return _status(self.worker_id, self.port, self.engine, self.counters, self.followers)

    async def stop(self) -> None:
        # Stop taking requests and let in-flight ones finish (the engine still runs), then
        # stop the weight feed and the engine, and flush the last rollout records. Every
        # step is bounded, so a stuck one is logged by name and the stop still ends.
        grace_s = self.settings.shutdown_grace_s
        await bounded("HTTP drain", self.runner.cleanup(), grace_s + 5)
        self.sweeper.cancel()
        await bounded("open trajectories", self.api.sessions.close_all(), grace_s + 5)
        self.heartbeat_task.cancel()
        await bounded("heartbeat", asyncio.gather(self.heartbeat_task, return_exceptions=True), 2)
        await bounded(
            "weight followers",
            asyncio.to_thread(_stop_followers, self.followers),
            5 * len(self.followers) + 2,
        )
        await bounded("engine", asyncio.to_thread(self.engine.stop), 15)
        self.engine.on_applied = None
        await bounded("applied-version writes", self.applied.drain(), 2)
        undelivered = await bounded("producer flush", asyncio.to_thread(self.producer.close), 15)
        if undelivered:
            log.warning("%d rollout records were still undelivered at shutdown", undelivered)
        await bounded("Redis close", self.redis.aclose(), 2)


async def start(
    stack: StackSettings, settings: InferenceSettings, engine: Engine | SGLangEngine | None = None
) -> InferenceServer:
    """A worker serving on ``settings.http_port`` (0: any free port, see ``port``).
    ``engine`` replaces the one built from ``settings`` (tests attach hooks to it)."""
    signer = settings.rollout_seal()
    if not settings.auth_required:
        log.warning("RTRL_INFERENCE_AUTH_REQUIRED=false: serving completions without an API key")
    policy = (
        Checkpoint.builtin_demo() if stack.model_dir is None else Checkpoint.open(stack.model_dir)
    )
    engine = engine or _engine(settings, policy)
    worker_id = f"inference-{stack.instance}"
    await asyncio.to_thread(kafka.wait_for_broker, stack)
    redis = aioredis.Redis.from_url(stack.redis_url)
    producer = kafka.AsyncProducer(stack, **{"message.timeout.ms": settings.produce_timeout_ms})
    followers = _follow_weights(stack, settings, engine, worker_id)
    applied = AppliedVersions(asyncio.get_running_loop(), redis, worker_id, followers)
    engine.on_applied = applied.from_engine_thread
    engine.start()
    api = CompletionsApi(
        settings,
        worker_id=worker_id,
        model_name=settings.model_name
        or (stack.model_dir.name if stack.model_dir is not None else "rtrl-demo-policy"),
        policy=policy,
        engine=engine,
        door=serving_door(stack, settings, redis),
        publisher=RolloutPublisher(
            producer,
            signer,
            redis,
            bulk.BulkStore(stack.resolved_rollout_bulk_dir()),
            max_record_bytes=stack.kafka_max_record_bytes,
            inline_bytes=settings.rollout_inline_bytes,
            served_ttl_s=settings.served_ttl_s,
        ),
        redis=redis,
    )
    runner, port = await _listen(settings, api)
    observe(engine, api.counters, followers, api.sessions)
    status = functools.partial(_status, worker_id, port, engine, api.counters, followers)
    beats = asyncio.create_task(_beat_forever(stack, settings, redis, engine, status))
    sweeper = asyncio.create_task(api.sessions.sweep())
    log.info("%s listening on http://%s:%d", worker_id, settings.bind_host, port)
    return InferenceServer(
        stack, settings, worker_id, engine, api, followers, applied, producer, redis, runner,
        port, beats, sweeper,
    )  # fmt: skip


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
            session_kv_tokens=settings.session_kv_tokens,
        )
    )


def _follow_weights(
    stack: StackSettings,
    settings: InferenceSettings,
    engine: Engine | SGLangEngine,
    worker_id: str,
) -> list[WeightFollower]:
    """A follower per arm staging weight_sync's versions into the embedded engine. SGLang
    gets its weights from its sidecar: none here."""
    if not settings.follow_weights or settings.backend != "embedded":
        return []
    assert isinstance(engine, Engine)  # what the embedded backend runs
    return [
        WeightFollower(
            functools.partial(engine.stage, arm),
            stack.weight_sync_addr,
            stack.weight_sync_subscribe_token.get_secret_value(),
            arm,
            worker_id,
            public_keys=signing.parse_public_keys(stack.manifest_public_keys),
            tls_ca_file=stack.weight_sync_tls_ca_file,
        ).start()
        for arm in ARMS
    ]


async def _listen(settings: InferenceSettings, api: CompletionsApi) -> tuple[web.AppRunner, int]:
    """The HTTP listener, serving; returns its runner and the port it is bound to."""
    app = web.Application()
    app.router.add_post("/v1/completions", api.handle)
    app.router.add_post("/v1/chat/completions", api.handle)
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/v1/models/{model}", api.models)
    # An agent whose base URL is all it lets you set: /v1/trajectories/{id} ties its turns.
    trajectory = "/v1/trajectories/{trajectory_id}"
    app.router.add_post(f"{trajectory}/chat/completions", api.handle)
    app.router.add_get(f"{trajectory}/models", api.models)
    app.router.add_get(f"{trajectory}/models/{{model}}", api.models)
    app.router.add_delete(trajectory, api.end_trajectory)
    app.router.add_get("/healthz", functools.partial(_healthz, api.engine, api.worker_id))
    runner = await serve_http(
        app,
        settings.bind_host,
        settings.http_port,
        settings.http_limits(),
        settings.http_context(),
        shutdown_timeout_s=settings.shutdown_grace_s,
    )
    return runner, runner.addresses[0][1]


async def _healthz(
    engine: Engine | SGLangEngine, worker_id: str, request: web.Request
) -> web.Response:
    return web.json_response(
        {"ready": engine.ready(), "versions": engine.versions(), "worker_id": worker_id}
    )


def _status(
    worker_id: str,
    port: int,
    engine: Engine | SGLangEngine,
    counters: RequestCounters,
    followers: Sequence[WeightFollower],
) -> heartbeat.InferenceBeat:
    stats = engine.stats
    return heartbeat.InferenceBeat(
        ready=engine.ready(),
        versions=engine.versions(),
        weights_digests=engine.digests(),
        http_port=port,
        worker_id=worker_id,
        completions=stats.completions,
        tokens=stats.tokens,
        swaps=stats.swaps,
        batches=stats.batches,
        queue_depth=engine.queue_depth(),
        rollout_records=counters.records,
        private_completions=counters.private,
        rejected=counters.rejected,
        unavailable=counters.unavailable,
        unrecorded=counters.unrecorded,
        weights_refused=sum(follower.refused for follower in followers),
    )


async def _beat_forever(
    stack: StackSettings,
    settings: InferenceSettings,
    redis: aioredis.Redis,
    engine: Engine | SGLangEngine,
    status: Callable[[], heartbeat.InferenceBeat],
) -> None:
    """Beat until the engine fails: then end with its error, so serve() ends and the
    supervisor restarts the worker."""
    while True:
        if engine.failure is not None:
            raise RuntimeError("the inference engine crashed") from engine.failure
        await heartbeat.beat(redis, SERVICE, stack.instance, status())
        await asyncio.sleep(settings.heartbeat_interval_s)


def _stop_followers(followers: Sequence[WeightFollower]) -> None:
    for follower in followers:
        follower.stop()


async def serve(stack: StackSettings, settings: InferenceSettings) -> None:
    """Run until SIGTERM or SIGINT (or until the engine or the heartbeat dies), then drain."""
    server = await start(stack, settings)
    try:
        await until_stopped(server.heartbeat_task)
    finally:
        await server.stop()
