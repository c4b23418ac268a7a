"""The load of `rtrl bench join`: rollouts of three records signed as their writers sign
them, produced as a backlog (the main load and its sentinels) or in real time (the live
rollouts), and the keys the bench's writers and joiners share."""

from __future__ import annotations

import os
import time
import uuid

from confluent_kafka import Producer
from rich.progress import Progress

from rtrl import kafka, signing, topics
from rtrl.bench.agent_load import agent_rollout
from rtrl.config import StackSettings
from rtrl.inference.config import InferenceSettings
from rtrl.v1 import rollout_pb2
from rtrl_client.v1 import telemetry_pb2

PARTITIONS = 4
TOKENS = 200
EDIT_TEXT = "".join(f"    value_{i} = compute(value_{i - 1}, scale={i})\n" for i in range(1, 12))
SENTINEL = "sentinel-"
LIVE = "live-"

Headers = list[tuple[str, bytes]]
"""A record's Kafka headers, as the joiner reads them (produced through
rtrl.kafka.kafka_headers, which types them as confluent_kafka's produce() wants)."""


def signing_keys() -> None:
    """Keys for the bench's writers and joiners (which inherit this environment), made for
    the run unless the environment holds them: the services have no default key."""
    for variable in ("RTRL_REWARD_TRAINER_MAC_KEY", "RTRL_REWARD_ANALYTICS_MAC_KEY"):
        os.environ.setdefault(variable, signing.generate_mac_key())
    os.environ.setdefault("RTRL_INFERENCE_ROLLOUT_SIGNING_KEY", signing.generate_private_key())
    mac_key = os.environ.setdefault("RTRL_INFERENCE_ROLLOUT_MAC_KEY", signing.generate_mac_key())
    os.environ.setdefault("RTRL_REWARD_ROLLOUT_MAC_KEYS", mac_key)
    event_key = os.environ.setdefault("RTRL_INGEST_EVENT_KEY", signing.generate_mac_key())
    os.environ.setdefault("RTRL_REWARD_EVENT_KEYS", event_key)
    os.environ.setdefault("RTRL_INGEST_ANALYTICS_EVENT_KEY", signing.generate_mac_key())


def rollout_signer() -> signing.Seal:
    """The inference workers' rollout seal: their signature and the joiner's MAC, which the
    joiners verify on every rollout (run() makes the keys unless the environment holds them)."""
    return InferenceSettings().rollout_seal()


def event_signer() -> signing.Seal:
    """The gateway's event seal: a MAC for the joiner, which verifies every event, and one for
    the analytics sink (run() makes the keys unless the environment holds them)."""
    return signing.Seal(
        signing.MacSigner(os.environ["RTRL_INGEST_EVENT_KEY"], signing.Purpose.EVENT),
        signing.MacSigner(os.environ["RTRL_INGEST_ANALYTICS_EVENT_KEY"], signing.Purpose.EVENT),
    )


def agent_tokens(index: int) -> int:
    """The trajectory tokens of the main load's rollout ``index``: one in twenty is an
    agent's, of 4k or 32k tokens (bench/agent_load.py); the rest are single turns (0)."""
    return {7: 4096, 27: 32768}.get(index % 40, 0)


def signed_records(
    rollout_id: str, ts_ms: int, signer: signing.Seal, events: signing.Seal, tokens: int = 0
) -> list[tuple[str, bytes, Headers]]:
    """rollout_records with the headers their writers send: the rollout sealed as a worker
    seals it, each event authenticated as the gateway does."""
    return [
        (topic, value, list((signer if topic == topics.ROLLOUT else events).headers(value)))
        for topic, value in rollout_records(rollout_id, ts_ms, tokens)
    ]


def rollout_records(
    rollout_id: str, ts_ms: int, tokens: int = 0, inline: bool = False
) -> list[tuple[str, bytes]]:
    """The three records of one rollout, as (topic, value): a single turn, or with
    ``tokens`` an agent's trajectory as its worker writes it (out of band unless ``inline``)."""
    record = rollout_pb2.RolloutRecord(
        event_id=str(uuid.uuid4()),
        rollout_id=rollout_id,
        session_id="bench",
        client_ts_ms=ts_ms,
        model_name="bench-policy",
        completion_text=EDIT_TEXT[:200],
        latency_s=0.4,
        completion_token_ids=[(7919 * i) % 50_000 for i in range(TOKENS)],
        completion_logprobs=[-0.01 * (i % 97) for i in range(TOKENS)],
    )
    shown = telemetry_pb2.TelemetryEvent(
        event_id=str(uuid.uuid4()),
        rollout_id=rollout_id,
        session_id="bench",
        client_ts_ms=ts_ms + 1,
        edit_shown=telemetry_pb2.EditShown(file_path="src/bench.py", edit_text=EDIT_TEXT),
    )
    kept = telemetry_pb2.TelemetryEvent(
        event_id=str(uuid.uuid4()),
        rollout_id=rollout_id,
        session_id="bench",
        client_ts_ms=ts_ms + 2,
        persistence=telemetry_pb2.PersistenceSnapshot(seconds_after_edit=30, region_text=EDIT_TEXT),
    )
    rollout = record.SerializeToString()
    if tokens:
        rollout = agent_rollout(tokens, rollout_id, ts_ms, inline)
    return [
        (topics.ROLLOUT, rollout),
        (topics.EDIT, shown.SerializeToString()),
        (topics.PERSISTENCE, kept.SerializeToString()),
    ]


def produce_load(
    stack: StackSettings,
    rollouts: int,
    spacing_ms: int,
    base_ms: int,
    close_after_ms: int,
    progress: Progress,
) -> tuple[list[str], int]:
    """The main load plus one sentinel per partition; returns the rollout ids and the bytes produced."""
    producer = Producer(
        kafka.producer_config(stack, **{"linger.ms": 20, "queue.buffering.max.messages": 200_000})
    )
    task = progress.add_task("producing", total=rollouts)
    signer, events = rollout_signer(), event_signer()
    ids, size = [], 0
    for i in range(rollouts):
        rollout_id = f"r{i:06d}"
        for topic, value, headers in signed_records(
            rollout_id, base_ms + spacing_ms * i, signer, events, agent_tokens(i)
        ):
            producer.produce(topic, value, key=rollout_id, headers=kafka.kafka_headers(headers))
            size += len(value)
        ids.append(rollout_id)
        if i % 500 == 0:
            producer.poll(0)
            progress.update(task, completed=i)
    # Explicit partitions: a sentinel must advance every partition's stream time.
    end_ms = base_ms + spacing_ms * rollouts + close_after_ms
    for partition in range(PARTITIONS):
        rollout_id = f"{SENTINEL}{partition}"
        for topic, value, headers in signed_records(rollout_id, end_ms, signer, events):
            producer.produce(
                topic,
                value,
                key=rollout_id,
                partition=partition,
                headers=kafka.kafka_headers(headers),
            )
        ids.append(rollout_id)
    assert producer.flush(60) == 0, "the broker did not take the load"
    progress.update(task, completed=rollouts)
    return ids, size


def produce_live(
    stack: StackSettings, rollouts: int, rate_per_s: float, progress: Progress
) -> dict[str, int]:
    """Rollouts produced in real time; returns rollout_id -> event time of its first event."""
    producer = Producer(kafka.producer_config(stack))
    task = progress.add_task("live rollouts", total=rollouts)
    opened, start = {}, time.monotonic()
    signer, events = rollout_signer(), event_signer()
    for i in range(rollouts):
        time.sleep(max(0.0, start + i / rate_per_s - time.monotonic()))
        rollout_id = f"{LIVE}{i:06d}"
        opened[rollout_id] = int(time.time() * 1000)
        for topic, value, headers in signed_records(rollout_id, opened[rollout_id], signer, events):
            producer.produce(topic, value, key=rollout_id, headers=kafka.kafka_headers(headers))
        producer.poll(0)
        progress.update(task, completed=i + 1)
    assert producer.flush(30) == 0
    return opened
