"""`rtrl up --model DIR` with a Hugging Face checkpoint of the user's (a tiny Qwen3 with a
byte-level BPE tokenizer and a Qwen3-style tool template, taught on the spot to play an
agent script: rtrl/ops/tiny_agent.py), then real HTTP traffic: chat requests to every
worker and their telemetry through ingest. The trainer trains on it and publishes
versions, every worker serves them, and `rtrl status` shows the train–inference mismatch.

First, an agent: OpenAI's SDK runs its tool-calling loop against a worker under one
trajectory id, and its telemetry follows; the trajectory's record goes through the
joiner to the trainer, which trains it, and to ClickHouse.

The simulated editor keeps an edit when its first sampled token is even (a preference
hinging on one token, which the policy can learn), and rewrites it otherwise.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field

import aiohttp
import openai
import pytest
from rich.console import Console

from rtrl.heartbeat import InferenceBeat, TrainerBeat
from rtrl.ingest.gateway import ACCEPTED
from rtrl.ops import health
from rtrl.ops.demo import simulator_key
from rtrl.ops.lifecycle import down, up
from rtrl.ops.reporting import query_function
from rtrl.ops.tiny_agent import write_tiny_agent
from rtrl.ops.tiny_model import write_tiny_checkpoint
from rtrl_client.client import IngestClient, make_event
from rtrl_client.v1 import telemetry_pb2
from support.agent import ANSWER, SCRIPT, TREATED, agent_loop

pytestmark = [pytest.mark.integration, pytest.mark.slow]

VERSIONS = 2
"""Treatment versions past the initial one the trainer must publish and every worker serve."""
BUDGET_S = 420.0


@dataclass
class Traffic:
    answers: list[dict] = field(default_factory=list)
    accepted_events: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Agent:
    run: dict
    """support.agent.agent_loop's result: the answers of each turn."""
    rollout_id: str
    trained: bool
    """A trainer candidate's journal entry names the trajectory."""
    rows: dict[str, int]
    """ClickHouse rows of the trajectory: its rollout, its rewards."""


@dataclass(frozen=True)
class Run:
    agent: Agent
    traffic: Traffic
    trainer: TrainerBeat
    workers: list[InferenceBeat]
    status_json: dict
    status_text: str
    model_name: str
    fingerprints: list[str]
    """The trainer's kept digests of the model's bytes (state_dir/cache)."""


def _beats(stack) -> tuple[TrainerBeat | None, list[InferenceBeat]]:
    rows = health.check(stack)
    trainer = next((r.beat for r in rows if isinstance(r.beat, TrainerBeat)), None)
    return trainer, [r.beat for r in rows if isinstance(r.beat, InferenceBeat)]


def _done(stack) -> bool:
    trainer, workers = _beats(stack)
    return (
        trainer is not None
        and trainer.version >= VERSIONS
        and len(workers) == 2
        and all(w.versions.get("treatment", -1) >= VERSIONS for w in workers)
    )


async def _editor(http, urls, ingest, key, rng, traffic: Traffic) -> None:
    url = rng.choice(urls)
    user = f"user-{rng.randrange(50)}"
    body = {
        "messages": [{"role": "user", "content": f"Rename variable {rng.randrange(10**6)} please"}],
        "user_id": user,
        "session_id": f"s-{user}",
        "max_tokens": 8,
    }
    headers = {"Authorization": f"Bearer {key}"}
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        if resp.status != 200:
            traffic.errors.append(f"{resp.status}: {(await resp.text())[:200]}")
            return
        answer = await resp.json()
    traffic.answers.append(answer)
    text = answer["choices"][0]["message"]["content"]
    kept = answer["token_ids"][0] % 2 == 0
    shown_ms = int(time.time() * 1000)
    await asyncio.sleep(0.3)  # the user's 0.3 s with the edit: seconds_after_edit below
    common = (str(answer["rollout_id"]), f"s-{user}", user)
    events = [
        make_event(
            *common,
            edit_shown=telemetry_pb2.EditShown(file_path="a.py", edit_text=text),
            client_ts_ms=shown_ms,
        ),
        make_event(
            *common,
            persistence=telemetry_pb2.PersistenceSnapshot(
                seconds_after_edit=0.3, region_text=text if kept else "rewritten by the user"
            ),
            client_ts_ms=int(time.time() * 1000),
        ),
    ]
    results = await ingest.publish(events, traceparent=answer.get("traceparent", ""))
    traffic.accepted_events += sum(r.status == ACCEPTED for r in results)


async def _drive(stack, key: str) -> Traffic:
    traffic = Traffic()
    urls = stack.urls("inference", "RTRL_INFERENCE_HTTP_PORT")
    ingest = IngestClient(stack.urls("ingest", "RTRL_INGEST_HTTP_PORT")[0], api_key=key)
    rng = random.Random(0)
    deadline = time.monotonic() + BUDGET_S
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        while time.monotonic() < deadline and not await asyncio.to_thread(_done, stack):
            await asyncio.gather(
                *(_editor(http, urls, ingest, key, rng, traffic) for _ in range(16))
            )
    await ingest.close()
    return traffic


async def _agent(stack, key: str) -> tuple[dict, str]:
    """The agent's loop against the first worker, then the product's telemetry about it:
    the edit shown, and kept."""
    url = stack.urls("inference", "RTRL_INFERENCE_HTTP_PORT")[0]
    client = openai.AsyncOpenAI(
        api_key=key, base_url=f"{url}/v1/trajectories/e2e-agent", max_retries=0
    )
    run = await agent_loop(client, "tiny-agent", user=TREATED)
    async with aiohttp.ClientSession() as http:
        headers = {"Authorization": f"Bearer {key}"}
        async with http.delete(f"{url}/v1/trajectories/e2e-agent", headers=headers) as resp:
            assert resp.status == 200, await resp.text()
    rollout_id = run["answers"][0].id
    ingest = IngestClient(stack.urls("ingest", "RTRL_INGEST_HTTP_PORT")[0], api_key=key)
    common = (rollout_id, "agent-session", TREATED)
    now = int(time.time() * 1000)
    answer = run["answers"][-1].choices[0].message.content
    await ingest.publish(
        [
            make_event(
                *common,
                edit_shown=telemetry_pb2.EditShown(file_path="a.py", edit_text=answer),
                client_ts_ms=now,
            ),
            make_event(
                *common,
                persistence=telemetry_pb2.PersistenceSnapshot(
                    seconds_after_edit=1.0, region_text=answer
                ),
                client_ts_ms=now + 1,
            ),
        ]
    )
    await ingest.close()
    return run, rollout_id


def _agent_landed(stack, state_dir, run: dict, rollout_id: str, timeout_s: float = 120) -> Agent:
    """Wait for the trajectory in ClickHouse (its rollout, its reward) and in the trainer's
    journal (a candidate that trained it)."""
    query = query_function(stack)
    journal = state_dir / "trainer" / "journal.jsonl"
    deadline = time.monotonic() + timeout_s
    while True:
        rows = {
            table: int(
                list(
                    query(f"SELECT count() FROM {table} WHERE rollout_id = '{rollout_id}'")[
                        0
                    ].values()
                )[0]
            )
            for table in ("rollouts", "rewards")
        }
        trained = journal.exists() and any(
            rollout_id in json.loads(line).get("ids", ())
            for line in journal.read_text().splitlines()
        )
        if (trained and all(rows.values())) or time.monotonic() > deadline:
            return Agent(run, rollout_id, trained, rows)
        time.sleep(1.0)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("model") / "tiny-agent"
    write_tiny_agent(model_dir, [SCRIPT])
    state_dir = tmp_path_factory.mktemp("stack")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RTRL_STATE_DIR", str(state_dir))
        env.setenv("RTRL_STACK_INFERENCE_WORKERS", "2")
        env.delenv("RTRL_MODEL_DIR", raising=False)
        console = Console(file=open(os.devnull, "w"))
        stack = up(state_dir, console, model_dir=model_dir)
        try:
            key = simulator_key(stack)
            agent_run, rollout_id = asyncio.run(_agent(stack, key))
            traffic = asyncio.run(_drive(stack, key))
            agent = _agent_landed(stack, state_dir, agent_run, rollout_id)
            trainer, workers = _beats(stack)
            assert trainer is not None
            status = [sys.executable, "-m", "rtrl", "status"]
            status_json = subprocess.run(
                [*status, "--json"], capture_output=True, text=True, check=True, timeout=120
            ).stdout
            status_text = subprocess.run(
                status,
                capture_output=True,
                text=True,
                check=True,
                timeout=120,
                env={**os.environ, "COLUMNS": "200"},
            ).stdout
            yield Run(
                agent,
                traffic,
                trainer,
                workers,
                json.loads(status_json),
                status_text,
                model_dir.name,
                sorted(p.name for p in (state_dir / "cache").glob("fingerprint-*")),
            )
        finally:
            down(state_dir, console)


def test_the_trainer_publishes_versions_of_your_model_and_every_worker_serves_them(run):
    assert not run.traffic.errors, run.traffic.errors[:3]
    assert run.trainer.version >= VERSIONS, run.trainer
    assert run.trainer.rollouts_trained > 0
    assert [w.versions["treatment"] >= VERSIONS for w in run.workers] == [True, True]
    # The serving answers came from the checkpoint: its name, its template, versions past v0.
    assert {a["model"] for a in run.traffic.answers} == {run.model_name}
    assert all(a["prompt_token_ids"][0] == 1 for a in run.traffic.answers)  # <|im_start|>
    served = {s["version"] for a in run.traffic.answers for s in a["policy_versions"]}
    assert max(served) >= 1
    assert run.traffic.accepted_events >= 2 * len(run.traffic.answers) * 0.9
    # The model's bytes were hashed once and the digest kept for the next start.
    assert len(run.fingerprints) == 1, run.fingerprints


def test_an_agents_trajectory_is_served_joined_trained_and_in_clickhouse(run):
    """An unmodified OpenAI agent, pointed at a worker: its three turns (two calls in
    parallel, a streamed turn, the answer) are one trajectory whose record the joiner
    rewards with the agent's telemetry, the trainer trains, and ClickHouse holds."""
    first, second, last = run.agent.run["answers"]
    assert [c.function.name for c in first.choices[0].message.tool_calls] == ["read_file"] * 2
    assert [c.function.name for c in second.choices[0].message.tool_calls] == ["search"]
    assert last.choices[0].message.content == ANSWER
    assert {a.id for a in run.agent.run["answers"]} == {run.agent.rollout_id}
    assert run.agent.rows == {"rollouts": 1, "rewards": 1}, run.agent
    assert run.agent.trained, run.agent


def test_status_shows_the_train_inference_mismatch(run):
    mismatch = run.trainer.mismatch
    assert mismatch is not None and mismatch.tokens > 0, run.trainer
    # Sampler and trainer run the same float32 arithmetic: they agree closely.
    assert mismatch.max < 1e-3, mismatch
    trainers = list(run.status_json["trainers"].values())
    assert trainers and trainers[0]["mismatch"]["tokens"] > 0, trainers
    assert "train–inference |Δ log p| mean" in run.status_text, run.status_text


def test_a_run_keeps_the_model_it_began_with(tmp_path, monkeypatch):
    """The run's model is pinned (owner-only, like the rest of the state directory): resuming
    it with no model resumes that model; naming another is refused before anything starts,
    with the command that resumes the run and the one that starts a new run."""
    from rtrl.ops import statedir
    from rtrl.ops.lifecycle import StackError, _pinned_run
    from rtrl.ops.run_pin import PIN_FILE

    monkeypatch.delenv("RTRL_MODEL_DIR", raising=False)
    model = write_tiny_checkpoint(tmp_path / "model", "llama")
    other = write_tiny_checkpoint(tmp_path / "other", "qwen2")
    state_dir = tmp_path / "state"
    statedir.prepare(state_dir, fresh=False)
    assert _pinned_run(state_dir, model).model_dir == str(model.resolve())
    assert (state_dir / PIN_FILE).stat().st_mode & 0o777 == 0o600
    assert _pinned_run(state_dir, model).model_dir == str(model.resolve())
    assert _pinned_run(state_dir, None).model_dir == str(model.resolve())
    with pytest.raises(StackError, match=r"`rtrl up` resumes it; `rtrl up --fresh --model .*other"):
        _pinned_run(state_dir, other)
    with pytest.raises(StackError, match="no config.json"):
        _pinned_run(tmp_path / "fresh-state", tmp_path)
