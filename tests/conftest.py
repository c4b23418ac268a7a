"""Fixtures that start the real embedded infrastructure on free ports.

Each integration test gets its own Tansu broker (memory-only, starts in well under a
second), so topics never leak between tests; redis-server is shared per session
and flushed per test; chdb data lives in the test's tmp_path.
"""

from __future__ import annotations

import os
import secrets
import sys
import warnings
from pathlib import Path
from typing import cast

import pytest
import redis

from rtrl import procs, signing
from rtrl.config import StackSettings

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The tests' processes and the stacks they start share a few cores (two in CI, split between
# two pytest workers): one thread each, and threads that sleep rather than spin while they
# wait. Spinning OpenMP threads on an oversubscribed machine made a 0.3 s training step take
# 7 s. Set before torch is imported, and inherited by every process a test starts.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The Triton kernels' tests run on this CPU through Triton's interpreter. Triton reads
# the variable once, when first imported, and torch or transformers may import it
# before those test modules do; TRITON_INTERPRET=0 runs them on a GPU instead.
os.environ.setdefault("TRITON_INTERPRET", "1")
# weight_sync has no default tokens: the tests' servers, trainers and workers (in process and
# as subprocesses, which inherit this environment) share a pair made for this run.
os.environ.setdefault("RTRL_WEIGHT_SYNC_TOKEN", secrets.token_urlsafe(24))
os.environ.setdefault("RTRL_WEIGHT_SYNC_SUBSCRIBE_TOKEN", secrets.token_urlsafe(24))
# Rewards carry a MAC for each reader, the trainer and the analytics sink, under a key the
# joiner shares with that reader alone (rtrl/signing.py): one pair of keys per run;
# support.trainer.produce seals the records tests write for a trainer as the joiner does.
os.environ.setdefault("RTRL_REWARD_TRAINER_MAC_KEY", signing.generate_mac_key())
os.environ.setdefault("RTRL_TRAINER_REWARD_MAC_KEYS", os.environ["RTRL_REWARD_TRAINER_MAC_KEY"])
os.environ.setdefault("RTRL_REWARD_ANALYTICS_MAC_KEY", signing.generate_mac_key())
os.environ.setdefault("RTRL_ANALYTICS_REWARD_MAC_KEYS", os.environ["RTRL_REWARD_ANALYTICS_MAC_KEY"])
os.environ.setdefault("RTRL_TRAINER_MANIFEST_SIGNING_KEY", signing.generate_private_key())
os.environ.setdefault(
    "RTRL_MANIFEST_PUBLIC_KEYS",
    signing.public_key_of(os.environ["RTRL_TRAINER_MANIFEST_SIGNING_KEY"]),
)
os.environ.setdefault("RTRL_INFERENCE_ROLLOUT_SIGNING_KEY", signing.generate_private_key())
os.environ.setdefault("RTRL_API_KEY_SIGNING_KEY", signing.generate_private_key())
os.environ.setdefault(
    "RTRL_API_KEY_PUBLIC_KEYS", signing.public_key_of(os.environ["RTRL_API_KEY_SIGNING_KEY"])
)
# The analytics sink verifies rollouts' signatures (it must not be able to forge one); the
# joiner checks rollouts' MACs.
os.environ.setdefault(
    "RTRL_ANALYTICS_ROLLOUT_PUBLIC_KEYS",
    signing.public_key_of(os.environ["RTRL_INFERENCE_ROLLOUT_SIGNING_KEY"]),
)
# Telemetry events carry a MAC for each reader, each under a key the gateway shares with it
# alone (the joiner, the sink), and rollouts one for the joiner;
# support.signing.worker_headers adds them to records tests write straight to Kafka.
os.environ.setdefault("RTRL_INGEST_EVENT_KEY", signing.generate_mac_key())
os.environ.setdefault("RTRL_REWARD_EVENT_KEYS", os.environ["RTRL_INGEST_EVENT_KEY"])
os.environ.setdefault("RTRL_INGEST_ANALYTICS_EVENT_KEY", signing.generate_mac_key())
os.environ.setdefault("RTRL_ANALYTICS_EVENT_KEYS", os.environ["RTRL_INGEST_ANALYTICS_EVENT_KEY"])
os.environ.setdefault("RTRL_INFERENCE_ROLLOUT_MAC_KEY", signing.generate_mac_key())
os.environ.setdefault("RTRL_REWARD_ROLLOUT_MAC_KEYS", os.environ["RTRL_INFERENCE_ROLLOUT_MAC_KEY"])


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("redis")
    proc = procs.start_redis(tmp, tmp / "redis.log")
    yield f"redis://127.0.0.1:{proc.port}/0"
    proc.stop()


@pytest.fixture(autouse=True)
def no_weight_sync_server_outlives_its_test():
    """A test that leaves an in-process weight_sync server running would have it beat
    into, and rebuild registries in, the Redis the next tests share: close it and say so."""
    yield
    support = sys.modules.get("support.weight_sync")
    if support is None:
        return
    for handle in list(support.InProcessServer.live):
        warnings.warn(f"a test left the weight_sync server on {handle.addr} running", stacklevel=1)
        handle.close()


@pytest.fixture
def redis_url(redis_server):
    client = redis.Redis.from_url(redis_server)
    client.flushdb()
    client.close()
    return redis_server


@pytest.fixture
def kafka_bootstrap(tmp_path):
    proc = procs.start_tansu(tmp_path / "tansu.log")
    yield f"127.0.0.1:{proc.port}"
    proc.stop()


@pytest.fixture
def stack_settings(kafka_bootstrap, redis_url, tmp_path) -> StackSettings:
    """Settings pointing at a fresh broker, a flushed Redis and a private state dir."""
    settings = StackSettings(
        kafka_bootstrap=kafka_bootstrap,
        redis_url=redis_url,
        state_dir=tmp_path / "state",
        kafka_partitions=4,
    )
    from rtrl.kafka import ensure_topics

    ensure_topics(settings)
    return settings


@pytest.fixture
def stack_env(stack_settings: StackSettings) -> dict[str, str]:
    """The same settings as environment variables, for services started as subprocesses."""
    return {
        "RTRL_KAFKA_BOOTSTRAP": stack_settings.kafka_bootstrap,
        "RTRL_REDIS_URL": stack_settings.redis_url,
        "RTRL_STATE_DIR": str(stack_settings.state_dir),
        "RTRL_KAFKA_PARTITIONS": str(stack_settings.kafka_partitions),
    }


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


# ---- weight_sync: a server in this process, its publisher, and real weights ----


@pytest.fixture(scope="module")
def policy_weights():
    import torch

    from rtrl.policy import build_model, state_dict_fp32

    torch.set_num_threads(1)
    return state_dict_fp32(build_model())


@pytest.fixture
def stack(redis_url, tmp_path) -> StackSettings:
    return StackSettings(redis_url=redis_url, state_dir=tmp_path / "state")


@pytest.fixture
def server(stack):
    from rtrl.weight_sync.config import WeightSyncSettings
    from support.weight_sync import InProcessServer

    # Small chunks so every keyframe spans many WeightChunks.
    handle = InProcessServer(
        WeightSyncSettings(port=procs.free_port(), chunk_bytes=64 * 1024, poll_interval_s=0.2),
        stack,
    )
    handle.start()
    yield handle
    handle.close()


@pytest.fixture
def publisher(server, stack):
    from rtrl.weight_sync.client import Publisher
    from support.weight_sync import ARM, MANIFEST_KEY

    client = Publisher(
        server.addr,
        stack.weight_sync_token.get_secret_value(),
        ARM,
        keyframe_every=20,
        signing_key=MANIFEST_KEY,
    )
    yield client
    client.close()


# ---- OpenTelemetry: in-memory SDK behind the API the services use ----


class _Recording:
    """A sampler that records spans only while a test asks for them (otel_memory):
    once installed the providers are global, and every later test's services would
    otherwise pile their spans up in memory."""

    def __init__(self) -> None:
        self.on = False

    def should_sample(
        self,
        parent_context,
        trace_id,
        name,
        kind=None,
        attributes=None,
        links=None,
        trace_state=None,
    ):
        from opentelemetry.sdk.trace.sampling import Decision, SamplingResult

        return SamplingResult(
            Decision.RECORD_AND_SAMPLE if self.on else Decision.DROP,
            attributes if self.on else None,
        )

    def get_description(self) -> str:
        return "on while a test uses otel_memory"


@pytest.fixture(scope="session")
def _otel_providers():
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
        InMemorySpanExporter,
    )
    from opentelemetry.sdk.trace.sampling import Sampler

    spans = InMemorySpanExporter()
    recording = _Recording()
    # Duck-typed: a Sampler subclass would import the SDK when pytest loads this conftest.
    tracer_provider = TracerProvider(sampler=cast(Sampler, recording))
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    trace.set_tracer_provider(tracer_provider)
    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    return spans, reader, recording


@pytest.fixture
def otel_memory(_otel_providers):
    """(span exporter, metric reader) installed as this process's global providers.

    Global providers can be set once per process, so every test that inspects spans or
    metrics shares them: spans are recorded only during such a test (and cleared after
    it); compare metric sums by delta."""
    spans, reader, recording = _otel_providers
    recording.on = True
    yield spans, reader
    recording.on = False
    spans.clear()
