"""`rtrl up` resumes whatever run its state directory holds (ops/run_pin.py): the model it
began with and the settings that decide what it trains toward, never a secret; a command
naming another model is told which command resumes the run and which starts a new one."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from rtrl.ops import run_pin, statedir
from rtrl.ops.demo import AGENT_TRAINER, run_demo
from rtrl.ops.lifecycle import _policy_env
from rtrl.ops.tiny_model import write_tiny_checkpoint

AGENT_RUN = {**AGENT_TRAINER, "RTRL_STACK_REWARD_FN_VERSION": "a2"}


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    path = tmp_path / "state"
    statedir.prepare(path, fresh=False)
    return path


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_tiny_checkpoint(tmp_path / "model", "llama")


def test_the_first_start_records_the_model_and_the_allow_listed_settings_only(state_dir):
    environ = {**AGENT_RUN, "RTRL_TRAINER_MANIFEST_SIGNING_KEY": "secret", "RTRL_TRAINER_LR": "1"}
    run = run_pin.pin(state_dir, "/models/agent", environ)
    assert run == run_pin.RunPin("/models/agent", AGENT_RUN)
    written = (state_dir / run_pin.PIN_FILE).read_text()
    assert "secret" not in written and "RTRL_TRAINER_LR" not in written
    assert (state_dir / run_pin.PIN_FILE).stat().st_mode & 0o777 == 0o600
    assert run_pin.read(state_dir) == run


@pytest.mark.parametrize(
    ("began_with", "named", "resumes"),
    [
        # No model named: whatever the run trains, the demo policy included.
        ("/models/agent", None, "/models/agent"),
        (None, None, None),
        # The same model named again.
        ("/models/agent", "/models/agent", "/models/agent"),
    ],
)
def test_a_run_resumes_with_the_model_it_began_with(state_dir, began_with, named, resumes):
    run_pin.pin(state_dir, began_with, AGENT_RUN)
    assert run_pin.pin(state_dir, named, {}) == run_pin.RunPin(resumes, AGENT_RUN)


@pytest.mark.parametrize(
    ("began_with", "named"), [("/models/agent", "/models/other"), (None, "/models/other")]
)
def test_naming_another_model_says_which_command_resumes_and_which_starts_over(
    state_dir, began_with, named
):
    run_pin.pin(state_dir, began_with, {})
    with pytest.raises(run_pin.PinMismatch) as refused:
        run_pin.pin(state_dir, named, {})
    assert f"trains {began_with or 'the demo policy'}, not {named}" in str(refused.value)
    assert f"`rtrl up` resumes it; `rtrl up --fresh --model {named}` starts a new run" in str(
        refused.value
    )
    assert run_pin.read(state_dir) == run_pin.RunPin(began_with, {})


def test_a_pin_written_before_settings_were_recorded_still_resumes(state_dir):
    (state_dir / run_pin.PIN_FILE).write_text(json.dumps({"model_dir": "/models/agent"}))
    assert run_pin.pin(state_dir, None, AGENT_RUN) == run_pin.RunPin("/models/agent", {})


def test_rtrl_up_resumes_the_pinned_model_under_its_settings_where_the_environment_sets_none(
    state_dir, model, monkeypatch
):
    for name in run_pin.RUN_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("RTRL_MODEL_DIR", raising=False)
    run_pin.pin(state_dir, str(model.resolve()), AGENT_RUN)
    monkeypatch.setenv("RTRL_TRAINER_EVAL_TASKS", "16")  # the operator's own choice wins
    console = Console(file=io.StringIO())
    env = _policy_env(state_dir, console, None)
    assert env["RTRL_MODEL_DIR"] == str(model.resolve())
    assert env["RTRL_TRAINER_EVAL_SUITE"] == AGENT_TRAINER["RTRL_TRAINER_EVAL_SUITE"]
    assert env["RTRL_STACK_REWARD_FN_VERSION"] == "a2"
    assert env["RTRL_TRAINER_EVAL_TASKS"] == "16"
    assert "RTRL_TRAINER_EVAL_SUITE=" in console.file.getvalue()  # type: ignore[attr-defined]


def test_the_single_turn_demo_refuses_to_resume_another_run_and_names_both_commands(
    state_dir, model
):
    run_pin.pin(state_dir, str(model), AGENT_RUN)
    console = Console(file=io.StringIO(), width=400)
    code = run_demo(
        state_dir,
        console,
        product="edits",
        minutes=0.1,
        keep_running=False,
        reward_fn=None,
        unique_prompts=False,
        fresh=False,
    )
    assert code == 1
    said = console.file.getvalue()  # type: ignore[attr-defined]
    assert "`rtrl up` resumes it; `rtrl demo --product edits --fresh` starts this demo over" in said
    assert not (state_dir / "stack.json").exists()
    # The phases and what they are expected to take were said before anything started.
    assert "rtrl demo --product edits: about 3 min on 2 cores" in said
    assert "~1 min, once" in said and "0.1 min" in said
