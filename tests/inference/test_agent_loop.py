"""An agent's tool-calling loop through the official OpenAI Python SDK, token in, token out.

The worker serves a tiny Qwen3 taught to play one agent script (rtrl/ops/tiny_agent.py):
it calls two tools in parallel, reads their results, searches, reads that, and answers.
The agent is OpenAI's usual loop: offer ``tools``, run the ``tool_calls`` answered, send
their results as ``role: "tool"`` messages, append the assistant's message as the SDK
returned it. Its base URL names the trajectory (``/v1/trajectories/{id}``), the one thing
an unmodified agent lets you set; a second client names it in ``extra_body``.

The trajectory's record must hold exactly the ids served: the first prompt, each turn's
sampled ids, and what each turn observed, each turn's prompt extending the last.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from rtrl import topics
from rtrl.analytics import schema
from rtrl.analytics.query import connect
from rtrl.api_keys import COMPLETIONS, issue_key
from rtrl.checkpoint import Checkpoint
from rtrl.inference.config import InferenceSettings
from rtrl.inference.engine import Engine
from rtrl.inference.server import start
from rtrl.ops.tiny_agent import Script, write_tiny_agent
from rtrl.policy import state_dict_fp32
from rtrl.reward_stream.config import RewardStreamSettings
from rtrl.reward_stream.runtime import Joiner
from rtrl.trainer.batch import SeenRollouts, TrainSample, collate, to_sample
from rtrl.trainer.step import rl_step, token_logprobs
from rtrl.trajectory import LinkReason, SegmentKind, Trajectory
from rtrl.trajectory_summary import Summary
from rtrl.trajectory_targets import targets
from rtrl.v1 import reward_pb2
from support import signed
from support.agent import (
    ANSWER,
    OPENING,
    SCRIPT,
    TOOL_PARAMS,
    TREATED,
    agent_loop,
)
from support.inference import read_rollouts
from support.signing import KEY_AUTHORITY

pytestmark = pytest.mark.integration

torch.set_num_threads(1)

THINKER = Script(
    opening=({"role": "user", "content": "Add two numbers."},),
    turns=(
        (
            "<think>\nUse plus.\n</think>\n\ndef add(a, b): return a + b",
            ({"role": "user", "content": "Now subtract them."},),
        ),
        ("<think>\nUse minus.\n</think>\n\ndef sub(a, b): return a - b", ()),
    ),
)
"""Qwen3 reasons in <think> blocks, and its template drops an earlier turn's block once a
new user message follows: re-rendering the history would change the ids it sampled."""


@pytest.fixture(scope="module")
def agent_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("agent") / "tiny-agent"
    write_tiny_agent(out, [SCRIPT, THINKER])
    return out


@pytest.fixture
def agent_server(stack_settings, agent_dir):
    """Start a worker serving the tiny agent (version 0 on both arms) inside a running
    event loop; yields (server, API key, root URL)."""
    policy = Checkpoint.open(agent_dir)
    weights = state_dict_fp32(policy.load_model())
    stack = stack_settings.model_copy(update={"model_dir": agent_dir})
    settings = InferenceSettings(http_port=0, follow_weights=False, max_tokens=200)

    @contextlib.asynccontextmanager
    async def serving(**overrides):
        server = await start(stack, settings.model_copy(update=overrides))
        try:
            assert isinstance(server.engine, Engine)
            for arm in ("control", "treatment"):
                server.engine.stage(arm, 0, weights)
            key = await issue_key(server.redis, KEY_AUTHORITY, "agents", scopes={COMPLETIONS})
            yield server, key, f"http://127.0.0.1:{server.port}"
        finally:
            await server.stop()

    return serving


def test_an_openai_agent_loop_is_one_trajectory_of_exactly_the_ids_served(
    stack_settings, agent_server
):
    async def scenario():
        async with agent_server() as (_, key, root):
            by_path = openai.AsyncOpenAI(
                api_key=key, base_url=f"{root}/v1/trajectories/run-1", max_retries=0
            )
            by_body = openai.AsyncOpenAI(api_key=key, base_url=f"{root}/v1", max_retries=0)
            model = (await by_path.models.list()).data[0].id
            runs = [
                await agent_loop(by_path, model),
                await agent_loop(by_body, model, extra_body={"trajectory_id": "run-2"}),
            ]
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}) as http:
                ended = [
                    (await http.delete(f"{root}/v1/trajectories/{tid}")).json()
                    for tid in ("run-1", "run-2")
                ]
                again = await http.delete(f"{root}/v1/trajectories/run-1")
            return runs, ended, again

    runs, ended, again = asyncio.run(scenario())
    records = {r.link.trajectory_id: r for r in read_rollouts(stack_settings)}
    assert sorted(records) == ["run-1", "run-2"]
    for tid, run, end in zip(("run-1", "run-2"), runs, ended, strict=True):
        answers = run["answers"]
        first, second, last = answers
        # The SDK read each turn: two calls in parallel, one after text, then the answer.
        assert first.choices[0].finish_reason == "tool_calls"
        assert [c.function.name for c in first.choices[0].message.tool_calls] == ["read_file"] * 2
        assert first.choices[0].message.content is None
        assert second.choices[0].finish_reason == "tool_calls"
        assert second.choices[0].message.content.strip() == "Let me search."
        assert [c.function.name for c in second.choices[0].message.tool_calls] == ["search"]
        assert (last.choices[0].finish_reason, last.choices[0].message.content) == ("stop", ANSWER)
        rollout_ids = {a.id for a in answers}
        assert len(rollout_ids) == 1 and end["rollout_id"] in rollout_ids
        assert (end["turns"], end["links"], end["recorded"]) == (3, 1, True)
        # Token in, token out: each turn's prompt extends the last turn's prompt and
        # sampled ids; the streamed turn's ids came chunk by chunk.
        turn_ids = [
            first.model_extra["token_ids"],
            run["streamed_ids"],
            last.model_extra["token_ids"],
        ]
        prompts = [
            first.model_extra["prompt_token_ids"],
            None,
            last.model_extra["prompt_token_ids"],
        ]
        served = prompts[2] + turn_ids[2]
        assert served[: len(prompts[0]) + len(turn_ids[0])] == prompts[0] + turn_ids[0]
        # The record holds exactly those ids: the prompt, then sampled and observed runs.
        record = records[tid]
        trajectory = Trajectory.of(record)
        assert record.rollout_id in rollout_ids
        kinds = [s.kind for s in trajectory.segments]
        assert kinds == [SegmentKind.GENERATED, SegmentKind.OBSERVED] * 2 + [SegmentKind.GENERATED]
        assert list(trajectory.prompt_ids) == prompts[0]
        assert [list(s.token_ids) for s in trajectory.generated] == turn_ids
        assert (
            list(trajectory.prompt_ids) + [i for s in trajectory.segments for i in s.token_ids]
            == served
        )
        assert [s.source for s in trajectory.segments if s.kind is SegmentKind.OBSERVED] == [
            "tool",
            "tool",
        ]
        assert all(len(s.logprobs) == len(s.token_ids) for s in trajectory.generated)
        # Every call recorded, with the id the client was answered and the turn it was in.
        answered = [c.id for a in answers[:2] for c in a.choices[0].message.tool_calls]
        assert [(c.id, c.turn, c.valid) for c in trajectory.tool_calls] == [
            (answered[0], 0, True),
            (answered[1], 0, True),
            (answered[2], 1, True),
        ]
        assert trajectory.link is not None
        assert (trajectory.link.position, trajectory.link.final) == (0, True)
        assert trajectory.link.reason is LinkReason.FIRST
        assert (trajectory.final_text, trajectory.finish_reason) == (ANSWER, "stop")
    assert again.status_code == 404


def test_the_sampled_ids_stay_where_re_rendering_would_change_them(
    stack_settings, agent_dir, agent_server
):
    """Token in, token out where it matters: the template drops the first turn's <think>
    block once the user speaks again, so a server that re-rendered the history would
    show the policy, and record, other ids than the ones it sampled."""
    policy = Checkpoint.open(agent_dir)

    async def scenario():
        async with agent_server() as (_, key, root):
            client = openai.AsyncOpenAI(
                api_key=key, base_url=f"{root}/v1/trajectories/think-1", max_retries=0
            )
            messages: list = [dict(m) for m in THINKER.opening]
            first = await client.chat.completions.create(model="m", messages=messages, seed=0)
            messages += [first.choices[0].message, dict(THINKER.turns[0][1][0])]
            second = await client.chat.completions.create(model="m", messages=messages, seed=1)
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}) as http:
                await http.delete(f"{root}/v1/trajectories/think-1")
            return first, second, messages

    first, second, messages = asyncio.run(scenario())
    assert first.choices[0].message.content == THINKER.turns[0][0]  # it reasoned first
    sampled = first.model_extra["token_ids"]
    prompt = second.model_extra["prompt_token_ids"]
    # The second turn's prompt holds the first turn's sampled ids, <think> block and all...
    assert prompt[: len(first.model_extra["prompt_token_ids"]) + len(sampled)] == (
        first.model_extra["prompt_token_ids"] + sampled
    )
    # ...where re-rendering the same history drops the block: other ids entirely.
    rendered = policy.render_chat(
        [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages]
    )
    assert "<think>" not in policy.tokenizer.decode(rendered)
    assert rendered != prompt
    (record,) = read_rollouts(stack_settings)
    trajectory = Trajectory.of(record)
    assert list(trajectory.generated[0].token_ids) == sampled
    served = prompt + second.model_extra["token_ids"]
    assert list(trajectory.prompt_ids) + [i for s in trajectory.segments for i in s.token_ids] == (
        served
    )
    assert [s.source for s in trajectory.segments] == ["", "user", ""]


def test_a_compacted_history_chains_links_that_one_reward_reaches_and_the_trainer_trains(
    stack_settings, agent_dir, agent_server
):
    """The agent replaces its history with a summary: the worker writes the first link,
    starts a second (``not_an_extension``) under the same rollout id, and the joiner gives
    both the one reward the chain earns; the trainer takes both, each its own sample."""

    async def scenario():
        async with agent_server() as (_, key, root):
            client = openai.AsyncOpenAI(
                api_key=key, base_url=f"{root}/v1/trajectories/chain-1", max_retries=0
            )
            messages: list = [dict(m) for m in OPENING]
            first = await client.chat.completions.create(
                model="m", messages=messages, tools=TOOL_PARAMS, seed=0, user=TREATED
            )
            summary: list[Any] = [
                dict(OPENING[0]),
                {"role": "user", "content": "Summary: add in a.py returns a - b. Fix it."},
            ]
            second = await client.chat.completions.create(
                model="m", messages=summary, tools=TOOL_PARAMS, seed=1, user=TREATED
            )
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}) as http:
                ended = (await http.delete(f"{root}/v1/trajectories/chain-1")).json()
            return first, second, ended

    first, second, ended = asyncio.run(scenario())
    assert first.id == second.id == ended["rollout_id"]
    assert (ended["links"], ended["turns"]) == (2, 2)
    assert second.model_extra["trajectory"] == {"id": "chain-1", "link": 1, "turn": 1}
    links = sorted(read_rollouts(stack_settings), key=lambda r: r.link.position)
    assert [(r.rollout_id, r.link.position, r.link.final) for r in links] == [
        (first.id, 0, False),
        (first.id, 1, True),
    ]
    chain = [Trajectory.of(r) for r in links]
    assert [t.link.reason for t in chain if t.link] == [
        LinkReason.FIRST,
        LinkReason.NOT_AN_EXTENSION,
    ]
    assert list(chain[1].prompt_ids) == second.model_extra["prompt_token_ids"]
    # The joiner: the final link completes the chain; one reward, a record per link.
    joiner = Joiner(RewardStreamSettings(window_s=1, grace_s=0).join_config())
    now = links[-1].client_ts_ms + 5_000
    for offset, record in enumerate(reversed(links)):  # the final link first: it waits
        joiner.feed_record(
            topics.ROLLOUT, 0, offset, record.rollout_id.encode(), record.SerializeToString(), now
        )
    rewards = [
        reward_pb2.RewardRecord.FromString(r.value)
        for r in joiner.tick(now + 60_000)
        if r.topic == topics.REWARD
    ]
    assert sorted(r.rollout.link.position for r in rewards) == [0, 1]
    assert len({r.reward for r in rewards}) == 1 and len({r.reward_id for r in rewards}) == 2
    # The trainer: both links are samples, each trained once, on its own tokens.
    policy = Checkpoint.open(agent_dir)
    taken = [to_sample(r, policy.max_positions, vocab_size=policy.spec.vocab_size) for r in rewards]
    samples = [s for s in taken if isinstance(s, TrainSample)]
    assert len(samples) == 2, taken
    assert sorted(s.rollout_id for s in samples) == sorted([first.id, f"{first.id}#1"])
    batch = collate(samples)
    generated = [len(s.completion_ids) for s in samples]
    assert batch.target_mask.sum(dim=1).tolist() == generated
    seen = SeenRollouts(capacity=16)
    assert [seen.admit(s.rollout_id) for s in samples] == [True, True]
    # A step moves both rows. The taught policy is all but certain of its tokens (no
    # gradient to see), so the step runs on a fresh model of its architecture.
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(policy.config)
    before = token_logprobs(model, batch)[0].detach()
    batch = dataclasses.replace(batch, advantages=(1.0, 1.0))
    rl_step(model, torch.optim.SGD(model.parameters(), lr=0.05), batch)
    after = token_logprobs(model, batch)[0].detach()
    moved = ((after - before) * batch.target_mask).sum(dim=1)
    assert (moved > 0).all(), moved  # both links' tokens made likelier


def test_each_token_of_a_trajectory_across_versions_is_its_versions_full_forward(
    stack_settings, agent_dir
):
    """Three turns over three versions: one swap lands inside the first turn (between
    two of its decode steps), one between the first and second turns. Under "recompute",
    every generated token's log-prob is the full forward of the version it names over
    the exact prefix the record holds, observed tokens included; observed tokens are
    context only, never a target of the loss."""
    policy = Checkpoint.open(agent_dir)
    base = state_dict_fp32(policy.load_model())
    generator = torch.Generator().manual_seed(0)
    versions = {
        v: {k: t + 0.05 * v * torch.randn(t.shape, generator=generator) for k, t in base.items()}
        for v in range(3)
    }
    stack = stack_settings.model_copy(update={"model_dir": agent_dir})
    settings = InferenceSettings(
        http_port=0, follow_weights=False, max_tokens=24, swap_policy="recompute"
    )

    async def scenario():
        server = await start(stack, settings)
        try:
            assert isinstance(server.engine, Engine)
            engine = server.engine
            for arm in ("control", "treatment"):
                engine.stage(arm, 0, versions[0])
            key = await issue_key(server.redis, KEY_AUTHORITY, "agents", scopes={COMPLETIONS})
            client = openai.AsyncOpenAI(
                api_key=key,
                base_url=f"http://127.0.0.1:{server.port}/v1/trajectories/versions-1",
                max_retries=0,
            )
            messages: list = [{"role": "user", "content": "Rename x to total."}]
            ask: dict[str, Any] = dict(model="m", max_tokens=24, user=TREATED)
            stream = await client.chat.completions.create(
                messages=messages, seed=0, stream=True, **ask
            )
            chunks = []
            async for chunk in stream:
                chunks.append(chunk)
                if len(chunks) == 3:  # mid-turn: the next decode steps run version 1
                    for arm in ("control", "treatment"):
                        await asyncio.to_thread(engine.stage, arm, 1, versions[1])
            messages += [
                {
                    "role": "assistant",
                    "content": "".join(c.choices[0].delta.content or "" for c in chunks),
                },
                {"role": "user", "content": "Now keep the tests passing."},
            ]
            for arm in ("control", "treatment"):  # between turns
                await asyncio.to_thread(engine.stage, arm, 2, versions[2])
            for turn in (1, 2):
                answer = await client.chat.completions.create(messages=messages, seed=turn, **ask)
                messages += [
                    answer.choices[0].message,
                    {"role": "user", "content": f"Thanks; step {turn} done."},
                ]
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}) as http:
                await http.delete(f"http://127.0.0.1:{server.port}/v1/trajectories/versions-1")
            return engine.sessions_resumed()
        finally:
            await server.stop()

    resumed, _ = asyncio.run(scenario())
    # The third turn resumed the second's keys and values (the same version); the second
    # could not (recompute: a new version since the first).
    assert resumed == 1
    (record,) = read_rollouts(stack_settings)
    trajectory = Trajectory.of(record)
    assert len(trajectory.generated) == 3
    per_turn = [sorted(set(s.versions)) for s in trajectory.generated]
    assert per_turn[0] == [0, 1], per_turn  # swapped inside the first turn
    assert per_turn[1] == per_turn[2] == [2], per_turn  # and between turns
    row = targets(trajectory)
    model = policy.load_model()
    full = {}
    for version, weights in versions.items():
        model.load_state_dict(weights)
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([row.input_ids])).logits[0, :-1].float()
        full[version] = torch.log_softmax(logits, -1)
    mask, logprobs, token_versions = row.mask(), row.logprobs(), row.versions()
    generated = 0
    for t, (weight, logprob, version) in enumerate(
        zip(mask, logprobs, token_versions, strict=True)
    ):
        if weight == 0.0:
            assert version == -1  # observed (or the prompt): context, not a target
            continue
        generated += 1
        expected = float(full[version][t, row.input_ids[t + 1]])
        assert logprob == pytest.approx(expected, abs=1e-5), (t, version)
    assert generated == len(trajectory.generated_ids)
    assert trajectory.observed_tokens > 0 and sum(mask) == generated
    round_trip(stack_settings, record, policy, row)


def round_trip(stack_settings, record, policy: Checkpoint, row) -> None:
    """The record through the joiner (one reward), the trainer (exactly its tokens, log-probs
    and versions) and ClickHouse (its link's row)."""
    joiner = Joiner(RewardStreamSettings(window_s=1, grace_s=0).join_config())
    now = record.client_ts_ms + 5_000
    value = record.SerializeToString()
    joiner.feed_record(topics.ROLLOUT, 0, 0, record.rollout_id.encode(), value, now)
    (reward,) = [
        reward_pb2.RewardRecord.FromString(r.value)
        for r in joiner.tick(now + 60_000)
        if r.topic == topics.REWARD
    ]
    assert reward.rollout == record
    sample = to_sample(reward, policy.max_positions, vocab_size=policy.spec.vocab_size)
    assert isinstance(sample, TrainSample), sample
    batch = collate([sample])
    assert batch.input_ids[0].tolist() == list(row.input_ids)
    assert batch.target_mask[0].tolist() == list(row.mask())
    assert batch.behaviour_logprobs[0].tolist() == pytest.approx(
        [lp if m else 0.0 for lp, m in zip(row.logprobs(), row.mask(), strict=True)]
    )
    assert sample.token_versions == Trajectory.of(record).generated_versions
    client = connect(stack_settings)
    schema.create_tables(client)
    sink = signed.checking_sink(client)
    sink.add(signed.record(topics.ROLLOUT, 0, 0, record.rollout_id.encode(), value))
    sink.flush()
    rows = client.query(
        "SELECT turns, versions_spanned, policy_version_min, policy_version_max, "
        "generated_tokens, observed_tokens FROM trajectory_links FINAL"
    ).result_rows
    summary = Summary.of(record)
    assert rows == [(3, 3, 0, 2, summary.generated_tokens, summary.observed_tokens)]


def test_a_trajectory_is_its_clients_and_a_lost_one_is_named(agent_server):
    """Attacks and failures on the trajectory routes: another client naming the same
    trajectory id gets a trajectory of its own (it cannot extend, read or end another's);
    ending one takes a valid key;
    a second turn while one is served is a 409; an id that is not an id is a 400; and a
    trajectory another run of the worker was serving (killed: its sessions gone) is a
    409 naming that worker, once, after which the id starts anew."""

    async def scenario():
        async with agent_server() as (server, key, root):
            other = await issue_key(server.redis, KEY_AUTHORITY, "intruder", scopes={COMPLETIONS})
            turn = {"model": "m", "messages": [dict(m) for m in OPENING], "max_tokens": 4}
            out: dict[str, Any] = {}
            async with httpx.AsyncClient(timeout=60) as http:

                async def ask(k, path, body=None):
                    headers = {"Authorization": f"Bearer {k}"}
                    return await http.post(f"{root}{path}", json=body or turn, headers=headers)

                mine = await ask(key, "/v1/trajectories/t-1/chat/completions")
                theirs = await ask(other, "/v1/trajectories/t-1/chat/completions")
                out["ids"] = (mine.json()["rollout_id"], theirs.json()["rollout_id"])
                ending = await http.delete(
                    f"{root}/v1/trajectories/t-1", headers={"Authorization": f"Bearer {other}"}
                )
                out["their_end"] = ending.json()
                out["ends_without_key"] = [
                    (await http.delete(f"{root}/v1/trajectories/t-1", headers=h)).status_code
                    for h in ({}, {"Authorization": "Bearer rtrl_not-a-key"})
                ]
                both = await asyncio.gather(
                    ask(key, "/v1/trajectories/t-2/chat/completions"),
                    ask(key, "/v1/trajectories/t-2/chat/completions"),
                )
                out["concurrent"] = sorted(r.status_code for r in both)
                out["bad_id"] = (await ask(key, "/v1/trajectories/a%20b/chat/completions")).json()
                body = {**turn, "trajectory_id": "x" * 129}
                out["long_id"] = (await ask(key, "/v1/chat/completions", body)).json()
                await server.redis.set("rtrl:trajectory:agents:t-3", "inference-9/0123456789ab")
                lost = await ask(key, "/v1/trajectories/t-3/chat/completions")
                out["lost"] = (lost.status_code, lost.json())
                out["anew"] = (await ask(key, "/v1/trajectories/t-3/chat/completions")).status_code
            out["open"] = len(server.api.sessions)
            return out

    out = asyncio.run(scenario())
    mine, theirs = out["ids"]
    assert mine != theirs  # the intruder's turn started its own trajectory
    assert out["their_end"]["rollout_id"] == theirs  # and ended only that one
    assert out["ends_without_key"] == [401, 401]  # no key, a forged key: nothing ends
    assert out["concurrent"] == [200, 409]
    assert out["bad_id"]["error"]["param"] == "trajectory_id"
    assert out["long_id"]["error"]["param"] == "trajectory_id"
    status, body = out["lost"]
    assert status == 409 and body["error"]["param"] == "trajectory_id"
    assert "'t-3'" in body["error"]["message"] and "'inference-9'" in body["error"]["message"]
    assert out["anew"] == 200
    assert out["open"] == 3  # t-1 (mine), t-2, t-3: open until ended or idle


def test_an_idle_trajectory_ends_and_is_written_once(stack_settings, agent_server):
    """An agent that never says it is done: its trajectory ends after
    trajectory_idle_s without a turn, and its record is written then, once; the id's
    next turn starts a new trajectory."""

    async def scenario():
        async with agent_server(trajectory_idle_s=1.0) as (server, key, root):
            client = openai.AsyncOpenAI(
                api_key=key, base_url=f"{root}/v1/trajectories/idle-1", max_retries=0
            )
            ask: dict[str, Any] = dict(model="m", messages=list(OPENING), max_tokens=4)
            first = await client.chat.completions.create(**ask)
            open_before = len(server.api.sessions)
            await asyncio.sleep(3.0)
            open_after = len(server.api.sessions)
            again = await client.chat.completions.create(**ask)
            return first, again, open_before, open_after

    first, again, open_before, open_after = asyncio.run(scenario())
    assert (open_before, open_after) == (1, 0)
    assert again.id != first.id  # a new trajectory under the same id
    records = read_rollouts(stack_settings)
    # The idle one, once; the second was still open at the stop, and the stop wrote it.
    assert sorted(r.rollout_id for r in records) == sorted([first.id, again.id])
    assert all(r.link.final and r.link.trajectory_id == "idle-1" for r in records)


def test_a_long_trajectory_ends_at_its_age_limit_which_the_joiners_wait_covers(
    stack_settings, agent_server
):
    """An agent that keeps working is not idle, yet its record must be written before the
    joiner stops waiting for it (the product's telemetry may already be there): the
    trajectory ends trajectory_max_s after its first turn, and by default the joiner waits
    longer than that plus the idle timeout."""
    defaults = InferenceSettings()
    assert RewardStreamSettings().max_wait_s >= (
        defaults.trajectory_max_s + defaults.trajectory_idle_s + 60
    )

    async def scenario():
        async with agent_server(trajectory_max_s=2.0, trajectory_idle_s=600) as (server, key, root):
            client = openai.AsyncOpenAI(
                api_key=key, base_url=f"{root}/v1/trajectories/old-1", max_retries=0
            )
            ask: dict[str, Any] = dict(model="m", messages=list(OPENING), max_tokens=4)
            first = await client.chat.completions.create(**ask)
            await asyncio.sleep(3.5)
            return first, len(server.api.sessions), read_rollouts(stack_settings)

    first, still_open, records = asyncio.run(scenario())
    assert still_open == 0
    assert [(r.rollout_id, r.link.final) for r in records] == [(first.id, True)]
