"""The inference worker against a real broker and Redis: one acked RolloutRecord per
non-private completion, version spans covering every token, clean SIGTERM."""

import asyncio
import functools
import json
import sys
import time

import aiohttp
import pytest
import redis
import torch

from rtrl import procs
from rtrl.api_keys import (
    COMPLETIONS,
    SERVED_PREFIX,
    issue_key,
    register_private_user,
    revoke_key,
)
from rtrl.heartbeat import InferenceBeat
from rtrl.inference.config import InferenceSettings
from rtrl.inference.engine import Engine, EngineConfig, EngineCrashed
from rtrl.inference.server import start
from rtrl.policy import BOS, build_model, state_dict_fp32
from rtrl.v1 import common_pb2
from support import wait
from support.beats import beat_of, wait_for_beat
from support.inference import read_rollouts
from support.signing import KEY_AUTHORITY

pytestmark = pytest.mark.integration

torch.set_num_threads(1)


async def post(
    http: aiohttp.ClientSession, port: int, key: str | None = None, **body
) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with http.post(
        f"http://127.0.0.1:{port}/v1/completions", json=body, headers=headers
    ) as resp:
        return resp.status, await resp.json()


@pytest.mark.guarantee(5)
def test_completions_produce_one_rollout_record_each(stack_settings):
    swap_at = 3

    def on_step(arm: str, generated: int) -> None:
        # The first treatment batch sees v1 go live after its third token.
        if arm == "treatment" and generated == swap_at and engine.held_version(arm) == 0:
            engine.stage(arm, 1, state_dict_fp32(build_model(seed=3)))

    engine = Engine(EngineConfig(batch_wait_s=0.02), on_step=on_step)
    settings = InferenceSettings(http_port=0, follow_weights=False, max_tokens=20)
    users = [f"user-{i}" for i in range(12)]

    async def scenario() -> tuple[list[dict], list[dict]]:
        server = await start(stack_settings, settings, engine=engine)
        key = await issue_key(server.redis, KEY_AUTHORITY, "editor", scopes={COMPLETIONS})
        beats = redis.Redis.from_url(stack_settings.redis_url)
        # Registered private at the gateway: private here too, whatever the request says.
        await register_private_user(server.redis, "registered-private")
        send = functools.partial(post, key=key)
        try:
            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://127.0.0.1:{server.port}/healthz") as resp:
                    assert (await resp.json())["ready"] is False
                engine.stage("control", 0, state_dict_fp32(build_model(seed=1)))
                engine.stage("treatment", 0, state_dict_fp32(build_model(seed=2)))
                public = [
                    send(http, server.port, prompt="@p1 say hi\n", user_id=u, session_id=f"s-{u}")
                    for u in users
                ]
                public.append(
                    send(
                        http,
                        server.port,
                        prompt="@p2 log ok\n",
                        user_id="tepid",
                        session_id="s",
                        temperature=0.5,
                        max_tokens=30,
                    )
                )
                private = [
                    send(
                        http,
                        server.port,
                        prompt="@p0 warn no\n",
                        user_id=f"p{i}",
                        session_id="sp",
                        privacy_mode=True,
                    )
                    for i in range(3)
                ]
                private.append(
                    send(
                        http,
                        server.port,
                        prompt="@p0 warn no\n",
                        user_id="registered-private",
                        session_id="sp",
                    )
                )
                # Served, never trained on: the caller picked the arm, or sampling outside the trained band.
                private += [
                    send(
                        http,
                        server.port,
                        prompt="@p2 log ok\n",
                        user_id="forced",
                        session_id="s",
                        arm="treatment",
                    ),
                    send(
                        http,
                        server.port,
                        prompt="@p2 log ok\n",
                        user_id="hot",
                        session_id="s",
                        temperature=5.0,
                    ),
                    send(
                        http,
                        server.port,
                        prompt="@p2 log ok\n",
                        user_id="narrow",
                        session_id="s",
                        top_p=0.5,
                    ),
                ]
                answers = await asyncio.gather(*public, *private)
                assert [status for status, _ in answers] == [200] * len(answers), answers
                bad = await send(http, server.port, prompt="é", user_id="u", session_id="s")
                assert bad[0] == 400 and "vocabulary" in bad[1]["error"]["message"]
                nobody = await send(http, server.port, prompt="x", user="")
                assert (nobody[0], nobody[1]["error"]["param"]) == (400, "user")
                async with http.get(f"http://127.0.0.1:{server.port}/healthz") as resp:
                    health = await resp.json()
                assert health == {
                    "ready": True,
                    "versions": {"control": 0, "treatment": 1},
                    "worker_id": "inference-0",
                }
                traffic_over = time.time()
                await wait.until_async(
                    lambda: beat_of(beats, InferenceBeat, after=traffic_over),
                    "a beat written after the traffic",
                    timeout_s=10 * settings.heartbeat_interval_s,
                    interval_s=0.1,
                )
            return [a for _, a in answers[: len(public)]], [a for _, a in answers[len(public) :]]
        finally:
            await server.stop()

    public, private = asyncio.run(scenario())

    records = {r.rollout_id: r for r in read_rollouts(stack_settings)}
    assert set(records) == {a["rollout_id"] for a in public}
    assert not {a["rollout_id"] for a in private} & set(records)
    for answer in public:
        record = records[answer["rollout_id"]]
        n = len(record.completion_token_ids)
        assert answer["usage"] == {
            "prompt_tokens": len(record.prompt_token_ids),
            "completion_tokens": n,
            "total_tokens": len(record.prompt_token_ids) + n,
        }
        assert len(record.completion_logprobs) == n and all(
            lp <= 0 for lp in record.completion_logprobs
        )
        spans = [(s.policy_version, s.start, s.end) for s in record.version_spans]
        assert spans[0][1] == 0 and spans[-1][2] == n
        assert all(a[2] == b[1] for a, b in zip(spans, spans[1:], strict=False))
        assert answer["policy_versions"] == [
            {"version": v, "start": s, "end": e} for v, s, e in spans
        ]
        assert (
            record.arm
            == {"control": common_pb2.ARM_CONTROL, "treatment": common_pb2.ARM_TREATMENT}[
                answer["arm"]
            ]
        )
        assert record.prompt_token_ids[0] == BOS and record.prompt_text == (
            "@p2 log ok\n" if record.user_id == "tepid" else "@p1 say hi\n"
        )
        assert record.completion_text == answer["text"] == answer["choices"][0]["text"]
        assert record.finish_reason == answer["finish_reason"] in ("stop", "length")
        assert record.worker_id == "inference-0" and record.schema_version == 1 and record.event_id
        assert record.session_id == f"s-{record.user_id}" or record.user_id == "tepid"
        assert record.sampling.seed == answer["seed"] and record.sampling.max_tokens == (
            30 if record.user_id == "tepid" else 20
        )
        assert 0 < record.time_to_first_token_s <= record.latency_s <= answer["latency_s"]
    tepid = next(r for r in records.values() if r.user_id == "tepid")
    assert tepid.sampling.temperature == pytest.approx(0.5)
    assert [a.get("not_recorded", "")[:20] for a in private] == [
        "",
        "",
        "",
        "",
        "the caller chose the",
        "temperature 5 is out",
        "top_p 0.5 is below t",
    ]
    swapped = [r for r in records.values() if len(r.version_spans) == 2]
    # v1 goes live after the first treatment batch's third token: a request in that batch
    # splits there; one that joined it a step or two later (its key check is an await)
    # splits earlier in its own tokens, never later.
    splits = [[(s.policy_version, s.start) for s in r.version_spans] for r in swapped]
    assert splits and all(
        split[0] == (0, 0) and split[1][0] == 1 and 0 < split[1][1] <= swap_at for split in splits
    ), splits
    assert [(0, 0), (1, swap_at)] in splits

    client = redis.Redis.from_url(stack_settings.redis_url)
    try:
        for arm, version in (("control", 0), ("treatment", 0), ("treatment", 1)):
            assert set(client.hgetall(f"rtrl:applied:{arm}:{version}")) == {b"inference-0"}
        beat = beat_of(client, InferenceBeat)
        assert beat is not None
        assert beat.ready is True and beat.versions == {"control": 0, "treatment": 1}
        assert (
            beat.rollout_records == len(public)
            and beat.private_completions == 4
            and beat.unrecorded == 3
        )
        # Each rollout names the client it was served to, and so does the gateway's record of it.
        assert {r.client_id for r in records.values()} == {"editor"}
        assert {
            rollout_id: client.get(SERVED_PREFIX + rollout_id) for rollout_id in records
        } == dict.fromkeys(records, b"editor")
    finally:
        client.close()


def test_streamed_completion_matches_its_answer_and_record(stack_settings):
    # stream=true: one chunk per token as sampled, text held back so no part of a stop
    # string is ever sent, then the last chunk; the rollout record is the same.
    settings = InferenceSettings(
        http_port=0, follow_weights=False, max_tokens=40, auth_required=False
    )

    async def scenario(body: dict) -> list[dict]:
        engine = Engine(EngineConfig())
        server = await start(stack_settings, settings, engine=engine)
        try:
            engine.stage("control", 0, state_dict_fp32(build_model(seed=1)))
            engine.stage("treatment", 0, state_dict_fp32(build_model(seed=1)))
            async with aiohttp.ClientSession() as http:
                async with http.post(
                    f"http://127.0.0.1:{server.port}/v1/completions", json=body
                ) as resp:
                    assert resp.status == 200 and resp.headers["Content-Type"].startswith(
                        "text/event-stream"
                    )
                    raw = (await resp.read()).decode()
        finally:
            await server.stop()
        chunks = [c.removeprefix("data: ") for c in raw.split("\n\n") if c]
        assert chunks[-1] == "[DONE]"
        return [json.loads(c) for c in chunks[:-1]]

    base = {"prompt": "@p1 say hi\n", "user_id": "u", "session_id": "s", "seed": 5}
    free = asyncio.run(scenario({**base, "stream": True}))
    *tokens, last = free
    record = next(r for r in read_rollouts(stack_settings) if r.rollout_id == last["rollout_id"])
    # OpenAI's text_completion chunks, each with the token it was sent for; the last one ends
    # the choice and carries the answer's own fields.
    assert {(c["id"], c["object"]) for c in free} == {(record.rollout_id, "text_completion")}
    assert [t["token_id"] for t in tokens] == list(record.completion_token_ids)
    assert last["token_ids"] == list(record.completion_token_ids)
    assert all(t["policy_version"] == 0 for t in tokens)
    assert [c["choices"][0]["finish_reason"] for c in free] == [None] * len(tokens) + [
        record.finish_reason
    ]
    text = "".join(c["choices"][0]["text"] for c in free)
    assert text == record.completion_text and len(tokens) == last["usage"]["completion_tokens"]

    stop = text[5:8]
    cut = text.find(stop)
    stopped = asyncio.run(scenario({**base, "stream": True, "stop": stop}))
    pieces = [c["choices"][0]["text"] for c in stopped]
    assert "".join(pieces) == text[:cut] and stopped[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(stop not in "".join(pieces[:i]) for i in range(len(pieces)))


def test_arm_without_weights_answers_503(stack_settings):
    settings = InferenceSettings(
        http_port=0, follow_weights=False, ready_timeout_s=0.3, auth_required=False
    )

    async def scenario():
        server = await start(stack_settings, settings)
        try:
            async with aiohttp.ClientSession() as http:
                return await post(
                    http,
                    server.port,
                    prompt="@p1 say hi\n",
                    user_id="u",
                    session_id="s",
                    arm="control",
                )
        finally:
            await server.stop()

    status, answer = asyncio.run(scenario())
    assert status == 503 and "no weights" in answer["error"]["message"]
    assert read_rollouts(stack_settings, timeout_s=1) == []


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_engine_bug_is_a_500_with_a_log_not_unavailable(stack_settings, caplog):
    # The engine thread dies of an error of its own (here, its step hook raises): the
    # request it held is a 500 and the traceback is in the log; nothing is counted as
    # unavailable (a 503 says "ask again", which would hide the bug), nothing is recorded.
    def on_step(arm: str, generated: int) -> None:
        raise KeyError("a bug in the engine")

    engine = Engine(EngineConfig(), on_step=on_step)
    settings = InferenceSettings(http_port=0, follow_weights=False, auth_required=False)

    async def scenario() -> tuple[int, int]:
        server = await start(stack_settings, settings, engine=engine)
        try:
            for arm in ("control", "treatment"):
                engine.stage(arm, 0, state_dict_fp32(build_model(seed=1)))
            async with aiohttp.ClientSession() as http:
                async with http.post(
                    f"http://127.0.0.1:{server.port}/v1/completions",
                    json={"prompt": "@p1 say hi\n", "user_id": "u", "session_id": "s"},
                ) as resp:
                    return resp.status, server.counters.unavailable
        finally:
            await server.stop()

    status, unavailable = asyncio.run(scenario())
    assert (status, unavailable) == (500, 0)
    # Logged twice: where the engine died, and where the request failed (with its traceback).
    failed_requests = [
        r for r in caplog.records if r.exc_info and isinstance(r.exc_info[1], EngineCrashed)
    ]
    assert failed_requests and "a bug in the engine" in str(failed_requests[0].exc_info[1])
    assert read_rollouts(stack_settings, timeout_s=1) == []


def test_worker_process_heartbeats_and_stops_on_sigterm(
    stack_env, stack_settings, repo_root, tmp_path
):
    port = procs.free_port()
    env = {
        **stack_env,
        "RTRL_INFERENCE_HTTP_PORT": str(port),
        "RTRL_INFERENCE_FOLLOW_WEIGHTS": "false",
        "RTRL_INSTANCE": "7",
    }
    proc = procs.spawn(
        "inference", [sys.executable, "-m", "rtrl.inference"], tmp_path / "inference.log", env=env
    )
    client = redis.Redis.from_url(stack_settings.redis_url)
    try:
        beat = wait_for_beat(
            client,
            InferenceBeat,
            "a first beat",
            instance="7",
            timeout_s=60,
            watching=[wait.Watched(proc, tmp_path / "inference.log")],
        )
        assert (
            beat.ready is False
            and beat.http_port == port
            and beat.versions == {"control": -1, "treatment": -1}
        )
        proc.popen.send_signal(15)
        assert proc.popen.wait(timeout=20) == 0, (tmp_path / "inference.log").read_text()
    finally:
        proc.stop()
        client.close()


def test_weights_follow_weight_sync(stack_settings):
    from rtrl.weight_sync.client import Publisher
    from rtrl.weight_sync.config import WeightSyncSettings
    from rtrl.weight_sync.server import WeightSyncServer
    from support.weight_sync import MANIFEST_KEY

    published = {
        ("control", 0): build_model(seed=1),
        ("treatment", 0): build_model(seed=1),
        ("treatment", 1): build_model(seed=5),
    }

    async def scenario():
        weight_sync = WeightSyncServer(WeightSyncSettings(port=0), stack_settings)
        port = await weight_sync.start()
        stack = stack_settings.model_copy(update={"weight_sync_addr": f"127.0.0.1:{port}"})
        token = stack.weight_sync_token.get_secret_value()
        server = await start(stack, InferenceSettings(http_port=0, auth_required=False))
        try:
            for arm in ("control", "treatment"):
                publisher = Publisher(stack.weight_sync_addr, token, arm, signing_key=MANIFEST_KEY)
                for (a, _), model in published.items():
                    if a == arm:
                        await asyncio.to_thread(publisher.publish, state_dict_fp32(model))
                publisher.close()
            await wait.until_async(
                server.engine.versions,
                "both arms' versions applied",
                ready=lambda versions: versions == {"control": 0, "treatment": 1},
            )
            assert isinstance(server.engine, Engine)  # the embedded backend, the default
            live = server.engine.live_weights("treatment")
            for name, tensor in state_dict_fp32(published[("treatment", 1)]).items():
                assert torch.equal(live[name], tensor), name
            async with aiohttp.ClientSession() as http:
                return await post(
                    http,
                    server.port,
                    prompt="@p1 say hi\n",
                    user_id="u",
                    session_id="s",
                    arm="treatment",
                )
        finally:
            await server.stop()
            await weight_sync.stop(grace_s=0)

    status, answer = asyncio.run(scenario())
    assert status == 200 and answer["policy_versions"] == [
        {"version": 1, "start": 0, "end": answer["usage"]["completion_tokens"]}
    ]
    client = redis.Redis.from_url(stack_settings.redis_url)
    try:
        assert client.hexists("rtrl:applied:treatment:1", "inference-0") and client.hexists(
            "rtrl:applied:control:0", "inference-0"
        )
    finally:
        client.close()


def test_the_serving_api_takes_only_completion_keys_and_holds_each_to_its_budgets(stack_settings):
    """Credentials on the serving API (issue 17): the key is checked from the headers before
    the body is read; 401/403 for who, 429 (with which budget) for how much, 413 past the
    server's own bound."""
    engine = Engine(EngineConfig(batch_wait_s=0.01))
    settings = InferenceSettings(
        http_port=0, follow_weights=False, max_tokens=8, ready_timeout_s=20, max_request_bytes=2048
    )

    async def scenario() -> None:
        server = await start(stack_settings, settings, engine=engine)
        redis_client = server.redis
        keys = {
            "plain": await issue_key(redis_client, KEY_AUTHORITY, "plain", scopes={COMPLETIONS}),
            "events-only": await issue_key(redis_client, KEY_AUTHORITY, "telemetry", scopes={"*"}),
            "revoked": await issue_key(redis_client, KEY_AUTHORITY, "gone", scopes={COMPLETIONS}),
            "slow": await issue_key(
                redis_client, KEY_AUTHORITY, "slow", scopes={COMPLETIONS}, rate_per_s=0.2, burst=2
            ),
            "one-at-a-time": await issue_key(
                redis_client, KEY_AUTHORITY, "serial", scopes={COMPLETIONS}, max_concurrency=1
            ),
            "short": await issue_key(
                redis_client, KEY_AUTHORITY, "short", scopes={COMPLETIONS}, max_tokens=4
            ),
            "small": await issue_key(
                redis_client, KEY_AUTHORITY, "small", scopes={COMPLETIONS}, max_request_bytes=200
            ),
        }
        await revoke_key(redis_client, KEY_AUTHORITY, keys["revoked"])
        ask = {"prompt": "@p1 say hi\n", "user_id": "u", "session_id": "s"}
        url = f"http://127.0.0.1:{server.port}/v1/completions"
        try:
            async with aiohttp.ClientSession() as http:
                # Nothing staged yet: this completion waits in flight while the next one asks.
                waiting = asyncio.ensure_future(
                    post(http, server.port, keys["one-at-a-time"], **ask)
                )
                await wait.until_async(
                    lambda: sum(server.door.in_flight.values()), "the first completion in flight"
                )
                status, answer = await post(http, server.port, keys["one-at-a-time"], **ask)
                assert status == 429 and "1 completions in flight" in answer["error"]["message"], (
                    answer
                )
                engine.stage("control", 0, state_dict_fp32(build_model(seed=1)))
                engine.stage("treatment", 0, state_dict_fp32(build_model(seed=1)))
                assert (await waiting)[0] == 200
                assert (await post(http, server.port, keys["one-at-a-time"], **ask))[
                    0
                ] == 200  # the slot is free again

                for key, status, reason in (
                    (None, 401, "missing API key"), ("rtrl_made-up", 401, "unknown API key"),
                    (keys["revoked"], 401, "revoked"), (keys["events-only"], 403, "may not ask for completions"),
                ):  # fmt: skip
                    got = await post(http, server.port, key, **ask)
                    assert got[0] == status and reason in got[1]["error"]["message"], (key, got)

                assert [
                    (await post(http, server.port, keys["slow"], **ask))[0] for _ in range(2)
                ] == [200, 200]
                async with http.post(
                    url, json=ask, headers={"Authorization": f"Bearer {keys['slow']}"}
                ) as resp:
                    assert (
                        resp.status == 429
                        and "completions/s" in (await resp.json())["error"]["message"]
                    )
                    assert int(resp.headers["Retry-After"]) >= 1

                assert (await post(http, server.port, keys["short"], **ask, max_tokens=4))[0] == 200
                got = await post(http, server.port, keys["short"], **ask, max_tokens=8)
                assert got[0] == 429 and "budget of 4 tokens" in got[1]["error"]["message"]
                got = await post(
                    http, server.port, keys["short"], **ask
                )  # the server's default (8) is over it too
                assert got[0] == 429

                long_ask = {**ask, "session_id": "s" * 300}
                got = await post(http, server.port, keys["small"], **long_ask)
                assert got[0] == 429 and "budget of 200 bytes" in got[1]["error"]["message"]
                assert (await post(http, server.port, keys["small"], **ask))[0] == 200
                got = await post(
                    http, server.port, keys["plain"], **{**ask, "session_id": "s" * 3000}
                )
                assert (
                    got[0] == 413 and "server's bound of 2048 bytes" in got[1]["error"]["message"]
                )

                # A chunked body (no Content-Length) is held to the same bounds as it is read.
                async def chunks():
                    yield json.dumps({**ask, "session_id": "s" * 3000}).encode()

                async with http.post(
                    url, data=chunks(), headers={"Authorization": f"Bearer {keys['plain']}"}
                ) as resp:
                    assert resp.status == 413

                # ...and a body that arrives in pieces is read whole.
                async def pieces():
                    body = json.dumps(ask).encode()
                    for start in range(0, len(body), 7):
                        yield body[start : start + 7]
                        await asyncio.sleep(0.01)

                async with http.post(
                    url, data=pieces(), headers={"Authorization": f"Bearer {keys['plain']}"}
                ) as resp:
                    assert resp.status == 200, await resp.text()
            assert server.door is not None and server.door.in_flight == {}
        finally:
            await server.stop()

    asyncio.run(scenario())
