"""The agentic product's pieces: the warm start trains on exactly the ids the serving API
renders for the same chat, it copies what it read in p4 only, a misspelt call ends its
trajectory, and in-process play answers calls as the product's editors do."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from rtrl.checkpoint import AGENT_CHAT_TEMPLATE, Checkpoint, write_demo_checkpoint
from rtrl.inference.tool_calls import family_of, parse
from rtrl.policy import EOS, PolicyConfig, build_model, decode, encode, state_dict_fp32
from rtrl.simulator import agent_play
from rtrl.simulator.agent import TOOL_NAMES, TOOLS, observe, render_calls
from rtrl.simulator.agent_warmstart import AgentRecipe, _drawn, conversation, encoded, habit
from rtrl.simulator.tasks import MIXED_PROJECT, PROJECT_STYLES, Style, Task, parse_style
from rtrl.simulator.users import population
from rtrl.trainer.sampling import Sampled

TINY = PolicyConfig(
    hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_positions=256
)


@pytest.fixture(scope="module")
def agent_checkpoint(tmp_path_factory) -> Checkpoint:
    out = tmp_path_factory.mktemp("agent") / "model"
    write_demo_checkpoint(out, state_dict_fp32(build_model(TINY)), TINY, AGENT_CHAT_TEMPLATE)
    return Checkpoint.open(out)


def test_the_warm_start_trains_on_the_ids_the_chat_template_renders(agent_checkpoint):
    """Every habit, in every style, written as the serving API would render the chat: the
    policy learns the very ids it will be served, and its calls parse as the bang family."""
    assert family_of(agent_checkpoint.tokenizer.chat_template) == "bang"
    rng = random.Random(3)
    tools = [tool.openai() for tool in TOOLS]
    kinds: Counter[tuple[bool, bool]] = Counter()
    for _ in range(60):
        task = Task(rng.randrange(5), "say", "hi", f"{rng.randrange(10**5):05d}")
        turns, broken = habit(rng)
        kinds[(len(turns) > 0, broken)] += 1
        for style in PROJECT_STYLES:
            written = style if task.project == MIXED_PROJECT else None
            messages = conversation(task, turns, broken, written, task.render(style))
            ids, mask = encoded(messages)
            rendered = agent_checkpoint.tokenize(
                agent_checkpoint.render_text(messages, tools, add_generation_prompt=False)
            )
            assert rendered == ids
            assert len(mask) == len(ids) - 1
            sampled = decode([i for i, m in zip(ids[1:], mask, strict=True) if m])
            assert sampled.endswith(task.render(style)) != broken
            for calls in turns:
                parsed = parse(render_calls(calls), TOOL_NAMES, "bang")
                assert [c.name for c in parsed.calls] == calls
                assert all(c.valid for c in parsed.calls) == (calls[0] in TOOL_NAMES)
    assert kinds[(False, False)] and kinds[(True, False)] and kinds[(True, True)]


def test_the_warm_start_copies_what_it_read_in_p4_and_guesses_elsewhere():
    rng = random.Random(5)
    copied: Counter[str] = Counter()
    guessed: Counter[str] = Counter()
    for _ in range(300):
        for task, ids, _ in _drawn(rng, 0.5):
            text = decode(ids)
            if "def " not in text:
                continue  # a misspelt call ended it, or a question
            style = parse_style(task, text[text.index("def ") :])
            assert style is not None
            for name, mark, value in (
                ("indent", "=indent ", lambda t: int(t[0])),
                ("quote", "=quote ", lambda t: t[0]),
            ):
                if mark in text:
                    copied[name] += getattr(style, name) == value(text.split(mark)[1])
                    copied[f"n_{name}"] += 1
                elif task.project == MIXED_PROJECT:
                    guessed[name] += getattr(style, name) in (2, "'")
                    guessed[f"n_{name}"] += 1
    assert copied["indent"] == copied["n_indent"] > 30
    assert copied["quote"] == copied["n_quote"] > 30
    for name in ("indent", "quote"):
        assert 0.3 < guessed[name] / guessed[f"n_{name}"] < 0.7


def test_only_a_p4_user_who_writes_their_style_down_has_anything_to_read():
    users = population(400, seed=7)
    written = [u.written_style for u in users if u.project == MIXED_PROJECT]
    assert 0.4 < sum(w is not None for w in written) / len(written) < 0.6
    assert all(u.written_style is None for u in users if u.project != MIXED_PROJECT)
    style = Style(4, "'")
    assert (observe("cfg", style), observe("read", style)) == ("indent 4", "quote '")
    assert {observe(name, None) for name in TOOL_NAMES} == {"none", "new file", "0 hits", "ok"}


NO_MODEL = torch.nn.Module()
"""play's model, never called: the scripted sampler stands in for it."""


class _Scripted:
    """Stands in for agent_play's sampler: each row's next turn from a script."""

    def __init__(self, script: list[list[str]]) -> None:
        self.script = script
        self.turn = 0

    def __call__(self, model, prompts, **_):
        out = [_turn(self.script[row][self.turn]) for row in range(len(prompts))]
        self.turn += 1
        return out


def _turn(text: str) -> Sampled:
    ids = encode(text) + [EOS]
    return Sampled(tuple(ids), tuple([-1.0] * len(ids)))


def test_play_answers_valid_calls_ends_at_an_answer_or_a_broken_turn(monkeypatch):
    task = Task(MIXED_PROJECT, "say", "hi", "00001")
    script = [
        ["!cfg\n!read\n", task.render(Style(4, "'"))],
        ["!raed\n", "unused"],
        ["!cfg\n!raed\n", task.render(Style(2, '"'))],
    ]
    monkeypatch.setattr(agent_play, "sample", _Scripted(script))
    runs = agent_play.play(NO_MODEL, [task] * 3, [Style(4, "'")] * 3, max_positions=256)
    monkeypatch.setattr(agent_play, "sample", _Scripted([script[0]]))
    (unwritten,) = agent_play.play(NO_MODEL, [task], [None], max_positions=256)
    both, broken, mixed = runs
    assert (both.turns, both.calls, both.broken, both.parallel_turns) == (2, ["cfg", "read"], 0, 1)
    assert "=indent 4\n=quote '\n" in decode(both.ids)
    assert both.tool_time_s == pytest.approx(0.4)
    assert parse_style(task, both.final_text) == Style(4, "'")
    assert (broken.turns, broken.broken, broken.final_text) == (1, 1, "!raed\n")
    assert (mixed.turns, mixed.broken) == (2, 1)
    assert "=indent 4\n" in decode(mixed.ids) and "=quote" not in decode(mixed.ids)
    assert both.observed == len(encode("=indent 4\n=quote '\n"))
    assert "=none\n=new file\n" in decode(unwritten.ids)
    assert both.generated == len(encode("!cfg\n!read\n")) + 1 + len(encode(script[0][1])) + 1


def test_the_agent_recipe_is_balanced_per_batch():
    ids, mask, projects = AgentRecipe(batch_size=16).batch(random.Random(0))
    assert ids.shape[0] == mask.shape[0] == projects.shape[0] == 16
    assert ids.shape[1] - 1 == mask.shape[1]
