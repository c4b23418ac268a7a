"""A model directory is the user's input, and opening one must not hand it the host: a chat
template is rendered under a time, an output and a memory bound (a template that breaks
one is refused where the directory is first opened, naming the template and the bound),
and a model that needs its own Python code is refused, never run and never prompted for."""

from __future__ import annotations

import json
import os
import pty
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rtrl.checkpoint import Checkpoint, CheckpointError
from rtrl.ops.tiny_model import write_tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]

CHATML_TAIL = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("hostile") / "qwen3", "qwen3")


def with_template(source: Path, target: Path, template: str) -> Path:
    directory = shutil.copytree(source, target)
    (directory / "chat_template.jinja").write_text(template)
    return directory


@pytest.fixture
def tight_bounds(monkeypatch):
    """Bounds small enough to hit quickly, as an operator would set them."""
    monkeypatch.setenv("RTRL_CHAT_TEMPLATE_TIMEOUT_S", "1")
    monkeypatch.setenv("RTRL_CHAT_TEMPLATE_MAX_CHARS", "100000")
    monkeypatch.setenv("RTRL_CHAT_TEMPLATE_MAX_MEMORY_MB", "256")


@pytest.mark.guarantee(7)
@pytest.mark.parametrize(
    ("template", "bound"),
    [
        # Ten billion iterations that print nothing: only a deadline ends it.
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "RTRL_CHAT_TEMPLATE_TIMEOUT_S",
        ),
        # Jinja folds constants while it compiles: a hundred-million-digit power spins in C, where no
        # check between loop steps could ever run.
        ("{{ 10 ** (10 ** 8) }}", "RTRL_CHAT_TEMPLATE_TIMEOUT_S"),
        # Ten megabytes of prompt from a few bytes of template.
        (
            "{% for i in range(100000) %}{{ messages[0]['content'] * 100 }}{% endfor %}",
            "RTRL_CHAT_TEMPLATE_MAX_CHARS",
        ),
        # One gigabyte in a single expression, before any output could be counted.
        ("{{ 'x' * 1000000000 }}", "RTRL_CHAT_TEMPLATE_MAX_MEMORY_MB"),
    ],
    ids=["loop", "power", "flood", "memory"],
)
def test_a_chat_template_over_its_bounds_is_refused_where_the_model_is_opened(
    qwen3, tmp_path, tight_bounds, template, bound
):
    """`rtrl up --model`, the trainer and the serving API all open the directory through
    Checkpoint.open: each refuses it, naming the template's file and the bound it broke."""
    hostile = with_template(qwen3, tmp_path / "hostile", template + CHATML_TAIL)
    with pytest.raises(CheckpointError) as refused:
        Checkpoint.open(hostile)
    assert str(hostile / "chat_template.jinja") in str(refused.value)
    assert bound in str(refused.value)


@pytest.mark.guarantee(7)
def test_rtrl_up_refuses_a_model_whose_template_loops_before_starting_anything(
    qwen3, tmp_path, tight_bounds
):
    from rtrl.ops.lifecycle import StackError, _pinned_run

    looping = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    hostile = with_template(qwen3, tmp_path / "hostile", looping + CHATML_TAIL)
    state = tmp_path / "state"
    state.mkdir()
    with pytest.raises(StackError, match="--model: .*RTRL_CHAT_TEMPLATE_TIMEOUT_S"):
        _pinned_run(state, hostile)
    assert list(state.iterdir()) == []  # the run is not pinned to it


# ---- models that need their own code ----------------------------------------------------

MARKER_CODE = """import os, pathlib
pathlib.Path(os.environ["RTRL_TEST_MARKER"]).write_text("custom code ran")
os._exit(3)
"""
"""The model's own code: it leaves a mark and ends the process, so a loader that runs it
is caught in the act and goes no further."""


def needing_code(source: Path, target: Path, where: str, model_type: str = "evil") -> Path:
    """A copy of ``source`` whose ``where`` (config.json or tokenizer_config.json) names
    code of its own in auto_map, the way Hugging Face custom models do."""
    directory = shutil.copytree(source, target)
    (directory / "configuration_evil.py").write_text(MARKER_CODE)
    (directory / "tokenization_evil.py").write_text(MARKER_CODE)
    config = json.loads((directory / "config.json").read_text())
    config["model_type"] = model_type
    (directory / "config.json").write_text(json.dumps(config))
    file = directory / where
    content = json.loads(file.read_text())
    content["auto_map"] = (
        {"AutoConfig": "configuration_evil.EvilConfig"}
        if where == "config.json"
        else {"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]}
    )
    file.write_text(json.dumps(content))
    return directory


@pytest.mark.guarantee(7)
@pytest.mark.parametrize(
    ("where", "model_type"),
    [
        ("config.json", "evil"),  # an architecture transformers has never heard of
        ("config.json", "qwen3"),  # a known one, with code of its own to replace it
        ("tokenizer_config.json", "qwen3"),  # a tokenizer with code of its own
    ],
)
def test_a_model_that_needs_custom_code_is_refused_saying_so(
    qwen3, tmp_path, monkeypatch, where, model_type
):
    marker = tmp_path / "ran"
    monkeypatch.setenv("RTRL_TEST_MARKER", str(marker))
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    custom = needing_code(qwen3, tmp_path / "custom", where, model_type)
    with pytest.raises(CheckpointError, match="needs custom code.*rtrl does not run"):
        Checkpoint.open(custom)
    assert not marker.exists()


@pytest.mark.guarantee(7)
def test_an_unknown_architecture_is_refused_as_needing_custom_code(qwen3, tmp_path):
    unknown = shutil.copytree(qwen3, tmp_path / "unknown")
    config = json.loads((unknown / "config.json").read_text())
    config["model_type"] = "not_in_transformers"
    (unknown / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="not_in_transformers.*needs custom code"):
        Checkpoint.open(unknown)


@pytest.mark.guarantee(7)
def test_rtrl_up_refuses_custom_code_at_a_terminal_without_asking(qwen3, tmp_path):
    """The operator's terminal, with "y" already typed: transformers' own prompt would
    read it and run the model's code. `rtrl up --model` must refuse before anything asks."""
    marker = tmp_path / "ran"
    custom = needing_code(qwen3, tmp_path / "custom", "config.json")
    env = {
        **os.environ,
        "RTRL_STATE_DIR": str(tmp_path / "state"),
        "RTRL_TEST_MARKER": str(marker),
        "HF_MODULES_CACHE": str(tmp_path / "hf_modules"),
        "HF_HUB_OFFLINE": "1",
    }
    env.pop("RTRL_MODEL_DIR", None)
    terminal, typed = pty.openpty()
    os.write(terminal, b"y\n")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "rtrl", "up", "--model", str(custom)],
            stdin=typed,
            capture_output=True,
            env=env,
            cwd=tmp_path,
            timeout=300,  # only detects a hang: a refusal takes seconds
        )
    finally:
        os.close(terminal)
        os.close(typed)
    said = " ".join((done.stdout + done.stderr).decode(errors="replace").split())
    assert not marker.exists(), said
    assert "Do you wish to run the custom code" not in said
    assert done.returncode == 1, said
    assert "needs custom code" in said and "rtrl does not run" in said


@pytest.mark.guarantee(7)
def test_the_sglang_rig_refuses_custom_code_and_never_trusts_it(qwen3, tmp_path, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("sglang_rig", REPO / "scripts" / "sglang_rig.py")
    assert spec is not None and spec.loader is not None
    rig = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "sglang_rig", rig)  # its dataclasses look themselves up
    spec.loader.exec_module(rig)
    assert not any("trust-remote-code" in flag for flag in rig.SERVER_FLAGS)
    monkeypatch.setenv("RTRL_TEST_MARKER", str(tmp_path / "ran"))
    custom = needing_code(qwen3, tmp_path / "custom", "config.json", "qwen3")
    with pytest.raises(ValueError, match="needs custom code"):
        rig.checkpoint_flags(custom)
    assert not (tmp_path / "ran").exists()
