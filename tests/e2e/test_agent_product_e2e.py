"""The agentic product (`rtrl demo`'s default) on the embedded stack: the demo agent's chat
template and tool syntax served by every worker, the product's harness calling tools over
several turns under one trajectory id, each trajectory recorded once with what the user
waited, settled by reward a2 and trained on; ClickHouse and reports/ab.json hold the A/B
with the trajectories' wall time as its latency.

The agent is the demo's warm start shrunk to a tiny model and a few hundred steps
(simulator/agent_warmstart.py): it calls tools wastefully and writes helpers badly, which is
all the loop needs to carry.
"""

from __future__ import annotations

import os

import pytest
from rich.console import Console

from rtrl.analytics.agents_report import agents_by_version
from rtrl.analytics.report import ab_json, ab_table
from rtrl.heartbeat import TrainerBeat
from rtrl.ops import health
from rtrl.ops.demo import AGENT_TRAINER, run_product
from rtrl.ops.lifecycle import down, up
from rtrl.ops.reporting import drain, query_function
from rtrl.simulator.agent_product import AgentArmStats
from support.trainer import tiny_agent_warm_start

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    model_dir = tiny_agent_warm_start()
    state_dir = tmp_path_factory.mktemp("stack")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RTRL_STATE_DIR", str(state_dir))
        env.setenv("RTRL_STACK_REWARD_FN_VERSION", "a2")
        for name, value in AGENT_TRAINER.items():
            env.setenv(name, value)
        env.setenv("RTRL_TRAINER_EVAL_TASKS", "16")
        env.delenv("RTRL_MODEL_DIR", raising=False)
        console = Console(file=open(os.devnull, "w"))
        stack = up(state_dir, console, model_dir=model_dir)
        try:
            stats = run_product(stack, 40, console, agent=True, users=120, clients=16)
            landed = drain(stack, stats, console)
            query = query_function(stack)
            trainer = next(r.beat for r in health.check(stack) if isinstance(r.beat, TrainerBeat))
            yield stats, landed, query, trainer
        finally:
            down(state_dir, console)


def test_the_harness_calls_tools_over_turns_and_every_trajectory_lands_once(run):
    stats, landed, query, _ = run
    assert stats.errors == 0, stats.last_error
    arms = [arm for arm in stats.arms.values() if isinstance(arm, AgentArmStats)]
    assert len(arms) == 2
    turns = [t for arm in arms for t in arm.turns]
    calls = [c for arm in arms for c in arm.tool_calls]
    assert sum(calls) > 0 and max(turns) > 1, "the warm start calls tools over several turns"
    (row,) = query("SELECT count() AS n, uniqExact(rollout_id) AS ids FROM trajectory_links FINAL")
    # every trajectory the product saw (privacy-mode users' are never recorded) is one link
    assert int(row["n"]) == int(row["ids"]) == stats.completions
    assert landed["rewards"] >= stats.completions


def test_the_latency_is_what_the_user_waited_tool_time_included(run):
    _, _, query, _ = run
    answered = "l.tool_calls > l.invalid_tool_calls AND l.turns > 1"
    (row,) = query(
        f"SELECT countIf({answered}) AS with_calls, "
        f"countIf({answered} AND r.wall_s >= r.latency_s + 0.4) AS waited "
        "FROM rollouts AS r FINAL JOIN trajectory_links AS l FINAL ON r.rollout_id = l.rollout_id"
    )
    # a turn with a valid call costs the editor at least 0.4 s (simulator/agent.py) before the
    # next turn (a turn of broken calls is answered as text: nothing runs)
    assert int(row["with_calls"]) > 0 and int(row["waited"]) == int(row["with_calls"])
    tables = ab_json(ab_table(query))
    for arm in ("control", "treatment"):
        whole = tables["whole_run"][arm]
        assert set(whole) == {
            "edits_persisted",
            "dissatisfied_followups",
            "latency_p50_ms",
            "rollouts",
        }
        assert whole["latency_p50_ms"] is not None and whole["latency_p50_ms"] > 0


def test_rewards_are_a2_with_an_effort_penalty_and_the_trainer_trains_on_them(run):
    _, _, query, trainer = run
    (row,) = query(
        "SELECT count() AS n, countIf(reward_fn_version = 'a2') AS a2, "
        "countIf(effort_penalty > 0) AS effort FROM rewards FINAL WHERE topic = 'rl.reward.v1'"
    )
    assert int(row["n"]) > 0 and int(row["a2"]) == int(row["n"]) == int(row["effort"])
    assert trainer.version >= 1, trainer
    agents = agents_by_version(query, buckets=4)
    assert {a.arm for a in agents} == {"control", "treatment"}
    assert all(a.latency_p50_s is not None for a in agents)
