"""Reward function r3: r1, except that a rollout that made no edit persisted nothing."""

from __future__ import annotations

import random

import pytest

from rtrl.reward_stream import reward
from rtrl.simulator.tasks import MIXED_PROJECT, PROJECT_STYLES, Task
from rtrl.simulator.users import User, react
from rtrl.v1 import rollout_pb2
from rtrl_client.v1 import telemetry_pb2

TASK = Task(project=2, verb="say", word="hi")
HELPER = TASK.render(PROJECT_STYLES[2])  # 2-space indent: no 4-space line anywhere
QUESTION = TASK.question("indent")
REJECTED = telemetry_pb2.EditOutcome(outcome=telemetry_pb2.EditOutcome.OUTCOME_REJECTED)


def rollout(text: str) -> rollout_pb2.RolloutRecord:
    return rollout_pb2.RolloutRecord(
        event_id="ro",
        rollout_id="r",
        client_ts_ms=1000,
        completion_text=text,
        completion_token_ids=[5] * len(text),
    )


def ev(event_id: str, **payload) -> telemetry_pb2.TelemetryEvent:
    return telemetry_pb2.TelemetryEvent(
        event_id=event_id, rollout_id="r", client_ts_ms=1100, **payload
    )


def shown(text: str) -> telemetry_pb2.TelemetryEvent:
    return ev("s", edit_shown=telemetry_pb2.EditShown(edit_text=text))


def snapshot(region: str) -> telemetry_pb2.TelemetryEvent:
    return ev(
        "p",
        persistence=telemetry_pb2.PersistenceSnapshot(seconds_after_edit=0.3, region_text=region),
    )


def followup(message: str) -> telemetry_pb2.TelemetryEvent:
    return ev("f", followup=telemetry_pb2.FollowUp(message=message))


CASES = {
    # A question nobody answered: r1 pays the neutral 0.5 for it, r3 nothing.
    "unanswered_question": (QUESTION, [], 0.5, 0.0),
    # Answered plainly: no complaint either way, still no edit.
    "answered_question": (QUESTION, [followup("2 spaces and double quotes")], 0.5, 0.0),
    # Prose that is not a question is no edit either.
    "prose_instead_of_an_edit": ("I would rather not touch this file.", [], 0.5, 0.0),
    # An edit whose telemetry never arrived: code in the completion, so neutral under both.
    "edit_with_lost_telemetry": (HELPER, [], 0.5, 0.5),
    # Edits with telemetry score the same under both.
    "edit_kept": (HELPER, [shown(HELPER), snapshot(HELPER)], 1.0, 1.0),
    "edit_half_rewritten": (
        HELPER,
        [
            shown(HELPER),
            snapshot(TASK.render(PROJECT_STYLES[0])),
            followup("no, we use double quotes here"),
        ],
        0.5,
        0.5,
    ),
    "edit_rejected": (HELPER, [shown(HELPER), ev("o", edit_outcome=REJECTED)], 0.0, 0.0),
    # The product showed the text as an edit: its word is taken, whatever the text looks like.
    "question_shown_as_an_edit": (QUESTION, [shown(QUESTION)], 0.5, 0.5),
}


@pytest.mark.parametrize(
    "text, telemetry, persisted_r1, persisted_r3", CASES.values(), ids=CASES.keys()
)
def test_r3_persistence(text, telemetry, persisted_r1, persisted_r3):
    r1 = reward.reward_record(rollout(text), telemetry, 9999, "r1")
    r3 = reward.reward_record(rollout(text), telemetry, 9999, "r3")
    assert (r1.components.persisted_fraction, r3.components.persisted_fraction) == (
        persisted_r1,
        persisted_r3,
    )
    # Everything else is r1's, and the scalar is r1's formula over r3's components.
    r1.components.persisted_fraction = r3.components.persisted_fraction
    assert r3.components == r1.components
    assert r3.reward == pytest.approx(reward.reward(r3.components))
    assert r3.reward_fn_version == "r3" and r3.reward_id != r1.reward_id


def expected_reward(
    version: str, completions: list[str], user: User, task: Task, seeds: int = 200
) -> float:
    """Mean reward of the completions (equally likely) over the user's reactions, with the
    telemetry the simulated product sends for each."""
    total = 0.0
    for seed in range(seeds):
        text = completions[seed % len(completions)]
        reaction = react(user, task, text, random.Random(seed))
        telemetry = (
            [] if reaction.region_text is None else [shown(text), snapshot(reaction.region_text)]
        )
        telemetry += [followup(reaction.followup)] if reaction.followup else []
        total += reward.reward_record(rollout(text), telemetry, 9999, version).reward
    return total / seeds


@pytest.mark.parametrize("version, asking_pays", [("r1", True), ("r3", False)])
def test_asking_instead_of_a_risky_edit_pays_only_under_r1(version, asking_pays):
    # In the mixed project no style can be learned: the best edit is a guess among four,
    # complained about three times in four. r1 pays more for a question than for that
    # guess, r3 less.
    task = Task(project=MIXED_PROJECT, verb="say", word="hi")
    user = User("u", MIXED_PROJECT, frozenset({"indent", "quote"}), own_style=PROJECT_STYLES[1])
    guess = expected_reward(version, [task.render(style) for style in PROJECT_STYLES], user, task)
    ask = expected_reward(version, [task.question("indent")], user, task)
    assert (ask > guess) is asking_pays
    assert abs(ask - guess) > 0.15
