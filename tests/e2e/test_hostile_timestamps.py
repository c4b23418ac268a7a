"""Hostile event times through every place one enters: the serving API and the gateway
refuse them naming the field and the reason, the joiner dead-letters them without moving
stream time, every sink stores what it can and dead-letters the rest, nothing crashes,
and honest rollouts sent afterwards get their real rewards (guarantee 2)."""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import time
import uuid
from dataclasses import dataclass

import aiohttp
import pytest
import redis
import torch
from confluent_kafka import Producer
from google.protobuf import json_format

from rtrl import kafka, procs, topics
from rtrl.analytics import schema
from rtrl.analytics.query import client_query_fn, connect, http_query_fn
from rtrl.analytics.rows import TS_MAX_MS
from rtrl.config import StackSettings
from rtrl.heartbeat import RewardStreamBeat
from rtrl.inference.config import InferenceSettings
from rtrl.inference.engine import Engine, EngineConfig
from rtrl.inference.server import start as start_inference
from rtrl.ingest.gateway import ACCEPTED, REJECTED
from rtrl.ingest.server import start as start_ingest
from rtrl.ingest.validation import validate
from rtrl.policy import build_model, state_dict_fp32
from rtrl.reward_stream import replay
from rtrl.reward_stream.config import RewardStreamSettings
from rtrl.reward_stream.runtime import Joiner
from rtrl.trainer.batch import TrainSample, collate, to_sample
from rtrl.v1 import common_pb2, reward_pb2, rollout_pb2, trainer_pb2
from rtrl_client.v1 import ingest_pb2, telemetry_pb2
from support import signed, wait
from support.analytics import RecordingConsumer, hand_made_records
from support.beats import wait_for_beat
from support.ingest import ingest_settings, read_topics, shown
from support.reward_stream import read_all, scenario, spawn_joiner
from support.signing import produce_as_its_writer, worker_headers

NOW_MS = 1_800_000_000_000


@dataclass(frozen=True)
class Case:
    json: str
    """``client_ts_ms`` as the client writes it in a JSON body."""
    record_ts: int | None
    """The int64 a record on a topic carries; None when no int64 can (the APIs refuse it first)."""
    inference: str
    """Part of the serving API's 400 reason (its ``field`` is always client_ts_ms)."""
    ingest: str
    """Part of the gateway's reason: a REJECTED result, or the 400 when the JSON has no int64 mapping."""
    joiner: str | None
    """Part of the ``error`` header the joiner dead-letters a record carrying ``record_ts`` with."""
    storable: bool | None
    """Whether the analytics sink stores a record carrying ``record_ts`` (False: a dead_letters row)."""

    @property
    def ts(self) -> int:
        """``record_ts`` of a case a record carries (one of ON_THE_WIRE)."""
        assert self.record_ts is not None, f"no record carries {self.json}"
        return self.record_ts

    @property
    def stored(self) -> bool:
        """``storable`` of a case a record carries (one of ON_THE_WIRE)."""
        assert self.storable is not None, f"no record carries {self.json}"
        return self.storable


CASES = {
    # Before the epoch: no clock reads this, and DateTime cannot store it.
    "negative": Case(
        "-1",
        -1,
        "7 days before the server clock",
        "7 days before the gateway clock",
        "is negative",
        False,
    ),
    # The proto default, "unset": it never stands for "now" downstream; 1970-01-01 is storable.
    "zero": Case(
        "0",
        0,
        "7 days before the server clock",
        "7 days before the gateway clock",
        "missing client_ts_ms",
        True,
    ),
    # 2000-01-01, a client clock decades behind (a dead clock battery): refused, dead-lettered, storable.
    "far_past": Case(
        "946684800000",
        946_684_800_000,
        "7 days before the server clock",
        "7 days before the gateway clock",
        "30 days before the joiner clock",
        True,
    ),
    # The year 2200: twelve of these once settled every honest rollout early with defaults.
    "year_2200": Case(
        "7258118400000",
        7_258_118_400_000,
        "5 minutes after the server clock",
        "5 minutes after the gateway clock",
        "10 minutes after the joiner clock",
        False,
    ),
    # 2^62: the OverflowError that crash-looped the analytics sink on one uncommitted record.
    "2^62": Case(
        str(2**62),
        2**62,
        "5 minutes after the server clock",
        "5 minutes after the gateway clock",
        "10 minutes after the joiner clock",
        False,
    ),
    # int64's largest value, as a JSON string (the proto3 JSON mapping of int64).
    "int64_max": Case(
        f'"{2**63 - 1}"',
        2**63 - 1,
        "5 minutes after the server clock",
        "5 minutes after the gateway clock",
        "10 minutes after the joiner clock",
        False,
    ),
    # One past int64: no record can carry it; both APIs refuse it before anything is produced.
    "2^64": Case(
        str(2**64),
        None,
        "5 minutes after the server clock",
        "clientTsMs field: Value out of range",
        None,
        None,
    ),
    # NaN-like strings: int64 may be a JSON string, but only a decimal integer.
    "nan_string": Case(
        '"NaN"',
        None,
        "valid integer",
        'clientTsMs field: Couldn\'t parse non-integer string: "NaN"',
        None,
        None,
    ),
    # Infinity spelled as a string: no int64 to map it to.
    "inf_string": Case(
        '"inf"',
        None,
        "valid integer",
        'clientTsMs field: Couldn\'t parse non-integer string: "inf"',
        None,
        None,
    ),
    # A float literal in a string, past any float's range: int64 strings take digits only.
    "1e400_string": Case(
        '"1e400"',
        None,
        "valid integer",
        'clientTsMs field: Couldn\'t parse non-integer string: "1e400"',
        None,
        None,
    ),
    # 1e400 as a JSON number: it overflows to inf in every parser.
    "1e400_number": Case(
        "1e400", None, "finite number", "clientTsMs field: Couldn't parse integer: inf", None, None
    ),
    # A bare NaN token: not JSON, but what Python's json module writes for float("nan").
    "bare_NaN": Case(
        "NaN", None, "finite number", "clientTsMs field: Couldn't parse integer: nan", None, None
    ),
}
ON_THE_WIRE = {name: case for name, case in CASES.items() if case.record_ts is not None}
# A hostile record as produced to a topic.
Hostile = rollout_pb2.RolloutRecord | telemetry_pb2.TelemetryEvent


def hostile_rollout(rollout_id: str, ts: int) -> rollout_pb2.RolloutRecord:
    return rollout_pb2.RolloutRecord(
        event_id=str(uuid.uuid4()),
        rollout_id=rollout_id,
        session_id="s",
        user_id="u",
        client_ts_ms=ts,
        completion_text="x = 1\n",
        completion_token_ids=[7] * 4,
        arm=common_pb2.ARM_TREATMENT,
    )


def hostile_followup(rollout_id: str, ts: int) -> telemetry_pb2.TelemetryEvent:
    return telemetry_pb2.TelemetryEvent(
        event_id=str(uuid.uuid4()),
        rollout_id=rollout_id,
        session_id="s",
        user_id="u",
        client_ts_ms=ts,
        schema_version=1,
        followup=telemetry_pb2.FollowUp(message="no, that broke the build"),
    )


def error_header(headers) -> str:
    return dict(headers)["error"].decode()


# ---- ingest: the same allow-list, one event refused, the rest of its batch written ----


@pytest.mark.parametrize("case", ON_THE_WIRE.values(), ids=ON_THE_WIRE.keys())
def test_gateway_validation_names_client_ts_and_the_reason(case):
    event = shown("r1", client_ts_ms=case.record_ts)
    rejection = validate(event, NOW_MS)
    assert (
        rejection is not None
        and rejection.field == "client_ts_ms"
        and case.ingest in rejection.reason
    )


@pytest.mark.integration
def test_gateway_refuses_hostile_times_and_writes_the_good_events_beside_them(stack_settings):
    now_ms = int(time.time() * 1000)
    good = [shown(f"good-{i}", client_ts_ms=now_ms) for i in range(2)]
    hostile = {
        name: shown(f"hostile-{name}", client_ts_ms=case.record_ts)
        for name, case in ON_THE_WIRE.items()
    }
    settings = ingest_settings()

    def body_with(token: str) -> str:
        event = json.loads(json_format.MessageToJson(shown("unparsable", client_ts_ms=now_ms)))
        event["clientTsMs"] = "@TS@"
        return json.dumps(
            {"events": [json.loads(json_format.MessageToJson(good[1])), event]}
        ).replace('"@TS@"', token)

    async def scenario_():
        server = await start_ingest(stack_settings, settings)
        base = f"http://127.0.0.1:{settings.http_port}/v1/events"
        try:
            async with aiohttp.ClientSession() as http:
                batch = ingest_pb2.PublishEventsRequest(events=[good[0], *hostile.values()])
                async with http.post(
                    base,
                    data=json_format.MessageToJson(batch),
                    headers={"Content-Type": "application/json"},
                ) as r:
                    assert r.status == 207
                    answer = json_format.Parse(await r.text(), ingest_pb2.PublishEventsResponse())
                unmappable = {}
                for name, case in CASES.items():
                    if case.record_ts is None:
                        async with http.post(
                            base,
                            data=body_with(case.json),
                            headers={"Content-Type": "application/json"},
                        ) as r:
                            unmappable[name] = (r.status, (await r.json())["error"])
                # The gateway is still up and writes what comes next.
                batch = ingest_pb2.PublishEventsRequest(events=[good[1]])
                async with http.post(
                    base,
                    data=json_format.MessageToJson(batch),
                    headers={"Content-Type": "application/json"},
                ) as r:
                    assert r.status == 200
        finally:
            await server.stop()
        return answer, unmappable

    answer, unmappable = asyncio.run(scenario_())
    assert answer.results[0].status == ACCEPTED
    for (name, case), result in zip(ON_THE_WIRE.items(), answer.results[1:], strict=True):
        assert (result.status, result.field) == (REJECTED, "client_ts_ms"), name
        assert case.ingest in result.error, (name, result.error)
    for name, (status, error) in unmappable.items():
        assert status == 400 and CASES[name].ingest in error, (name, error)
    landed = [
        event.rollout_id for items in read_topics(stack_settings).values() for _, event in items
    ]
    assert sorted(landed) == ["good-0", "good-1"]


# ---- inference: the serving API refuses them with 400 before generating ----


@pytest.mark.integration
def test_serving_api_refuses_hostile_client_ts_and_records_an_honest_one(stack_settings):
    torch.set_num_threads(1)
    settings = InferenceSettings(
        http_port=0, follow_weights=False, max_tokens=8, auth_required=False
    )
    engine = Engine(EngineConfig(batch_wait_s=0.01))
    honest_ts = int(time.time() * 1000) - 1000

    async def post(http, port: int, token: str) -> tuple[int, dict]:
        body = (
            '{"prompt": "@p1 say hi\\n", "user_id": "u", "session_id": "s", "client_ts_ms": '
            + token
            + "}"
        )
        async with http.post(
            f"http://127.0.0.1:{port}/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        ) as resp:
            return resp.status, await resp.json()

    async def run():
        server = await start_inference(stack_settings, settings, engine=engine)
        try:
            engine.stage("control", 0, state_dict_fp32(build_model(seed=1)))
            engine.stage("treatment", 0, state_dict_fp32(build_model(seed=2)))
            async with aiohttp.ClientSession() as http:
                refused = {
                    name: await post(http, server.port, case.json) for name, case in CASES.items()
                }
                honest = await post(http, server.port, str(honest_ts))
            return refused, honest, server.status()
        finally:
            await server.stop()

    refused, (status, answer), counters = asyncio.run(run())
    for name, (code, body) in refused.items():
        assert (
            code == 400
            and body["error"]["param"] == "client_ts_ms"
            and CASES[name].inference in body["error"]["message"]
        ), (name, body)
    assert status == 200, answer
    assert (
        counters.rejected == len(CASES)
        and counters.rollout_records == 1
        and counters.completions == 1
    )
    [record] = [m for m in read_all(stack_settings, (topics.ROLLOUT,))[topics.ROLLOUT]]
    assert rollout_pb2.RolloutRecord.FromString(record.value()).client_ts_ms == honest_ts


# ---- the joiner: dead-lettered with the reason, stream time untouched ----


@pytest.mark.parametrize("case", ON_THE_WIRE.values(), ids=ON_THE_WIRE.keys())
def test_joiner_dead_letters_a_hostile_time_and_settles_the_next_honest_rollout_with_its_real_reward(
    case,
):
    joiner = Joiner(RewardStreamSettings(window_s=1, grace_s=0.5).join_config())
    hostile: list[tuple[str, Hostile]] = [
        (topics.ROLLOUT, hostile_rollout("hostile-r", case.record_ts)),
        (topics.FOLLOWUP, hostile_followup("hostile-f", case.record_ts)),
    ]
    for offset, (topic, message) in enumerate(hostile):
        [dead] = joiner.feed(
            topic, 0, offset, message.rollout_id.encode(), message.SerializeToString(), NOW_MS
        )
        assert dead.topic == topics.REWARD_DLQ and dead.value == message.SerializeToString()
        assert (
            case.joiner in error_header(dead.headers)
            and dict(dead.headers)["source_topic"] == topic.encode()
        )
    assert joiner.states[0].stream_time_ms <= NOW_MS
    # An honest rollout right after: every event joins, none is late, the reward is its own.
    rollout_id, record, events, expected = scenario(0, NOW_MS + 10)
    outputs = joiner.feed(
        topics.ROLLOUT, 0, 5, rollout_id.encode(), record.SerializeToString(), NOW_MS + 20
    )
    for offset, (topic, event) in enumerate(events, start=10):
        outputs += joiner.feed(
            topic, 0, offset, rollout_id.encode(), event.SerializeToString(), NOW_MS + 30
        )
    outputs += joiner.tick(NOW_MS + 10_000)
    [settled] = outputs
    reward = reward_pb2.RewardRecord.FromString(settled.value)
    assert settled.topic == topics.REWARD and not reward.defaulted
    assert (reward.components.persisted_fraction, sorted(reward.event_ids)) == (
        expected["persisted_fraction"],
        expected["event_ids"],
    )
    assert joiner.counters.dlq == 2 and joiner.counters.late == 0


@pytest.mark.parametrize("case", ON_THE_WIRE.values(), ids=ON_THE_WIRE.keys())
def test_replay_skips_a_hostile_time_as_the_live_joiner_does(case):
    config = RewardStreamSettings(window_s=1, grace_s=0.5).join_config()
    honest = []
    for i in range(4):
        rollout_id, record, events, _ = scenario(i, NOW_MS + 10 * i)
        honest.append(
            replay.RetainedRecord(
                topics.ROLLOUT, 0, rollout_id.encode(), record.SerializeToString(), NOW_MS
            )
        )
        honest += [
            replay.RetainedRecord(t, 0, rollout_id.encode(), e.SerializeToString(), NOW_MS)
            for t, e in events
        ]
    hostile = [
        replay.RetainedRecord(
            topics.ROLLOUT,
            0,
            b"hostile-r",
            hostile_rollout("hostile-r", case.record_ts).SerializeToString(),
            NOW_MS,
        ),
        replay.RetainedRecord(
            topics.FOLLOWUP,
            0,
            b"hostile-f",
            hostile_followup("hostile-f", case.record_ts).SerializeToString(),
            NOW_MS,
        ),
    ]
    alone = replay.rejoin(honest, config, "r3")
    beside = replay.rejoin(hostile + honest, config, "r3")
    assert beside.records == alone.records and len(alone.records) == 4
    assert (beside.skipped, beside.late, beside.dropped) == (2, 0, 0)


@pytest.mark.guarantee(2)
@pytest.mark.integration
def test_joiner_service_dead_letters_future_records_then_settles_honest_rollouts_with_real_rewards(
    stack_settings, stack_env, redis_url, tmp_path
):
    service = spawn_joiner(stack_env, tmp_path)
    try:
        producer = Producer(kafka.producer_config(stack_settings))
        hostile: list[tuple[str, Hostile]] = [
            (topics.ROLLOUT, hostile_rollout(f"y2200-{i}", CASES["year_2200"].ts))
            for i in range(12)
        ]
        hostile += [
            (topics.ROLLOUT, hostile_rollout(f"hostile-{name}", case.ts))
            for name, case in ON_THE_WIRE.items()
        ]
        hostile += [
            (topics.FOLLOWUP, hostile_followup(f"hostile-{name}", case.ts))
            for name, case in ON_THE_WIRE.items()
        ]
        for topic, message in hostile:
            # Signed as a worker signs: refused for their time, not for who wrote them.
            produce_as_its_writer(producer, topic, message.SerializeToString(), message.rollout_id)
        assert producer.flush(10) == 0
        hb = redis.Redis.from_url(redis_url)
        wait_for_beat(
            hb,
            RewardStreamBeat,
            "every hostile event dead-lettered",
            ready=lambda beat: beat.dlq >= len(hostile),
        )
        # Honest rollouts after the hostile ones, on the same partitions.
        base_ms = int(time.time() * 1000)
        honest = {
            rid: (record, events, expected)
            for rid, record, events, expected in (scenario(i, base_ms) for i in range(8))
        }
        for rollout_id, (record, events, _) in honest.items():
            producer.produce(
                topics.ROLLOUT,
                record.SerializeToString(),
                key=rollout_id,
                headers=kafka.kafka_headers(
                    worker_headers(topics.ROLLOUT, record.SerializeToString())
                ),
            )
            for topic, event in events:
                value = event.SerializeToString()
                produce_as_its_writer(producer, topic, value, rollout_id)
        assert producer.flush(10) == 0
        status = wait_for_beat(
            hb,
            RewardStreamBeat,
            "every honest rollout settled",
            ready=lambda beat: beat.settled >= len(honest) and beat.pending == 0,
        )
        assert {k: getattr(status, k) for k in ("settled", "dlq", "late", "dropped")} == {
            "settled": len(honest),
            "dlq": len(hostile),
            "late": 0,
            "dropped": 0,
        }
        out = read_all(stack_settings, (topics.REWARD, topics.REWARD_DLQ))
    finally:
        service.stop(timeout_s=20)
    assert service.popen.returncode == 0, (tmp_path / "reward_stream.log").read_text()[-3000:]
    for message in out[topics.REWARD]:
        reward = reward_pb2.RewardRecord.FromString(message.value())
        _, _, expected = honest[reward.rollout_id]
        assert (
            reward.defaulted == expected["defaulted"]
            and sorted(reward.event_ids) == expected["event_ids"]
        ), reward.rollout_id
        assert reward.components.persisted_fraction == expected["persisted_fraction"]
        assert reward.components.dissatisfied == expected["dissatisfied"]
    assert sorted(
        reward_pb2.RewardRecord.FromString(m.value()).rollout_id for m in out[topics.REWARD]
    ) == sorted(honest)
    reasons = {m.value(): error_header(m.headers()) for m in out[topics.REWARD_DLQ]}
    assert set(reasons) == {message.SerializeToString() for _, message in hostile}
    for _topic, message in hostile:
        case = (
            CASES["year_2200"]
            if message.rollout_id.startswith("y2200")
            else ON_THE_WIRE[message.rollout_id.removeprefix("hostile-")]
        )
        assert case.joiner is not None, message.rollout_id
        assert case.joiner in reasons[message.SerializeToString()], message.rollout_id


# ---- the sinks: stored when a column can hold it, else a dead_letters row; always committed past ----


def sink_records(name: str, ts: int) -> list[tuple[str, bytes, tuple]]:
    """(topic, value, headers) of every record kind the sink turns into a row with a timestamp."""
    rollout = hostile_rollout(f"sink-{name}", ts)
    reward = reward_pb2.RewardRecord(
        reward_id=f"rw-{name}",
        rollout_id=rollout.rollout_id,
        rollout=rollout,
        last_event_ts_ms=ts,
        settled_ts_ms=ts,
    )
    step = trainer_pb2.TrainerStep(step_id=f"step-{name}", lineage="l", step=1, ts_ms=ts)
    followup = hostile_followup(rollout.rollout_id, ts)
    return [
        (topics.ROLLOUT, rollout.SerializeToString(), ()),
        (topics.FOLLOWUP, followup.SerializeToString(), ()),
        (topics.REWARD, reward.SerializeToString(), ()),
        (topics.TRAINER_STEPS, step.SerializeToString(), ()),
        # as the joiner sets it aside on .late, with its headers
        (
            topics.REWARD_LATE,
            followup.SerializeToString(),
            (("source_topic", topics.FOLLOWUP.encode()), ("kind", b"followup")),
        ),
    ]


BOUNDARY = {
    **{name: (case.ts, case.stored) for name, case in ON_THE_WIRE.items()},
    # The last millisecond DateTime holds (2106-02-07 06:28:15.999 UTC), and the first it does not.
    "datetime_max": (TS_MAX_MS, True),
    "datetime_max_plus_1": (TS_MAX_MS + 1, False),
}


def test_sink_stores_what_its_columns_hold_and_dead_letters_the_rest(tmp_path):
    client = connect(StackSettings(state_dir=tmp_path))
    try:
        schema.create_tables(client)
        consumer = RecordingConsumer()
        # The recording double stands in for the sink's confluent_kafka Consumer.
        sink = signed.checking_sink(client, consumer, batch_size=1000)
        offset = 0
        expected_letters, next_offsets = set(), {}
        for name, (ts, storable) in BOUNDARY.items():
            for topic, value, headers in sink_records(name, ts):
                sink.add(signed.record(topic, 0, offset, f"sink-{name}".encode(), value, headers))
                if not storable:
                    expected_letters.add((topic, offset))
                offset += 1
                next_offsets[(topic, 0)] = offset
        sink.flush()
        # Committed past everything, the dead letters included.
        assert consumer.commits == [next_offsets]
        query = client_query_fn(client)
        letters = query("SELECT topic, offset, reason FROM dead_letters FINAL")
        assert {(d["topic"], d["offset"]) for d in letters} == expected_letters
        assert all(
            "cannot be stored" in d["reason"] and "1970-01-01 to 2106-02-07" in d["reason"]
            for d in letters
        )
        stored = {
            r["rollout_id"]: r["ts"]
            for r in query(
                "SELECT rollout_id, toUnixTimestamp64Milli(ts) AS ts FROM rollouts FINAL"
            )
        }
        assert stored == {
            f"sink-{name}": ts for name, (ts, storable) in BOUNDARY.items() if storable
        }
        steps = query("SELECT count() AS n FROM trainer_steps FINAL")
        assert steps == [{"n": sum(storable for _, storable in BOUNDARY.values())}]
    finally:
        client.close()


@pytest.mark.guarantee(2)
@pytest.mark.integration
def test_sink_process_dead_letters_an_unstorable_record_and_commits_past_it(
    stack_settings, stack_env, tmp_path, repo_root
):
    port = procs.free_port()
    token = secrets.token_urlsafe(16)
    env = {
        **stack_env,
        "RTRL_ANALYTICS_QUERY_PORT": str(port),
        "RTRL_ANALYTICS_FLUSH_INTERVAL_S": "0.2",
        "RTRL_ANALYTICS_QUERY_TOKEN": token,
        "PYTHONPATH": str(repo_root),
    }
    rollouts, rewards = hand_made_records()
    hostile = [
        (topics.ROLLOUT, hostile_rollout("r-2^62", 2**62)),
        (topics.FOLLOWUP, hostile_followup("r-2200", CASES["year_2200"].ts)),
        (
            topics.REWARD,
            reward_pb2.RewardRecord(
                reward_id="rw-max", rollout_id="r-max", rollout=hostile_rollout("r-max", 2**63 - 1)
            ),
        ),
    ]
    producer = Producer(kafka.producer_config(stack_settings))
    for topic, message in [
        *hostile,
        *((topics.ROLLOUT, r) for r in rollouts),
        *((topics.REWARD, r) for r in rewards),
    ]:
        signed.produce(producer, topic, message.SerializeToString(), message.rollout_id)
    assert producer.flush(10) == 0
    sink = procs.spawn(
        "analytics",
        [sys.executable, "-m", "rtrl.analytics"],
        tmp_path / "analytics.log",
        env=env,
        port=port,
    )
    try:
        procs.wait_for_port(port, timeout_s=30)
        query = http_query_fn(f"http://127.0.0.1:{port}", token)
        counts = (
            "SELECT (SELECT count() FROM rollouts FINAL) AS rollouts, "
            "(SELECT count(DISTINCT reward_id) FROM rewards) AS rewards, "
            "(SELECT count() FROM dead_letters FINAL) AS letters"
        )
        wait.until(
            lambda: query(counts),
            "the sink to catch up",
            ready=lambda rows: (
                rows
                == [{"rollouts": len(rollouts), "rewards": len(rewards), "letters": len(hostile)}]
            ),
            timeout_s=60,
            interval_s=0.3,
            watching=[wait.Watched(sink, tmp_path / "analytics.log")],
        )
        letters = query("SELECT topic, reason FROM dead_letters FINAL ORDER BY topic")
    finally:
        sink.stop(timeout_s=30)
    assert sink.popen.returncode == 0, (tmp_path / "analytics.log").read_text()[-3000:]
    assert sorted(d["topic"] for d in letters) == sorted(t for t, _ in hostile)
    reasons = {d["topic"]: d["reason"] for d in letters}
    assert reasons[topics.ROLLOUT].startswith(f"client_ts_ms {2**62} cannot be stored")
    assert reasons[topics.FOLLOWUP].startswith(
        f"client_ts_ms {CASES['year_2200'].record_ts} cannot be stored"
    )
    assert reasons[topics.REWARD].startswith(f"rollout.client_ts_ms {2**63 - 1} cannot be stored")
    lag = kafka.consumer_lag(
        stack_settings, "analytics", (topics.ROLLOUT, topics.REWARD, topics.FOLLOWUP)
    )
    assert sum(p.lag for p in lag) == 0 and {p.topic for p in lag if p.committed > 0} == {
        topics.ROLLOUT,
        topics.REWARD,
        topics.FOLLOWUP,
    }


# ---- the trainer: event times only ride along (staleness is by version) ----


@pytest.mark.parametrize("case", ON_THE_WIRE.values(), ids=ON_THE_WIRE.keys())
def test_trainer_takes_a_reward_whatever_its_event_time(case):
    rollout = hostile_rollout("r", case.record_ts)
    rollout.prompt_token_ids.extend([1, 5, 6])
    rollout.completion_logprobs.extend([-0.5] * 4)
    rollout.version_spans.add(policy_version=0, start=0, end=4)
    rollout.sampling.temperature = 1.0
    record = reward_pb2.RewardRecord(
        reward_id="rw", rollout_id="r", rollout=rollout, reward=1.0, last_event_ts_ms=case.record_ts
    )
    sample = to_sample(record, max_positions=64)
    assert isinstance(sample, TrainSample) and sample.last_event_ts_ms == case.record_ts
    assert collate([sample]).input_ids.shape[0] == 1
