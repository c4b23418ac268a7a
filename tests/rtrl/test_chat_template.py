"""Chat templates rendered in bounded renderer processes (rtrl/chat_template.py): the text
is transformers' own, character for character, for the templates a model ships (ChatML,
the demo policy's, a Hermes-style tool-calling one); a renderer killed at its deadline is
replaced; and a renderer does not outlive the process it renders for."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rtrl.chat_template import ChatRenderer, ChatTemplateSettings, TemplateFailed, TemplateOverBound
from rtrl.checkpoint import DEMO_CHAT_TEMPLATE, Checkpoint
from rtrl.ops.tiny_model import CHATML, bpe_tokenizer, write_tiny_checkpoint
from support.wait import until

# Written for these tests in the shape of Hermes/Qwen tool templates: tools as JSON in the
# system turn, tool calls and tool results, a namespace, loop controls, the generation
# tag, and the globals transformers defines.
HERMES_TOOLS = """{%- set ns = namespace(system=none) -%}
{%- if messages[0]['role'] == 'system' %}{% set ns.system = messages[0]['content'] %}{% endif -%}
<|im_start|>system
{{ ns.system or 'You are a helpful assistant.' }} Today is {{ strftime_now('%Y') }}.
{%- if tools %}

# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
{%- endif %}<|im_end|>
{% for message in messages %}
{%- if message['role'] == 'system' %}{% continue %}{% endif %}
{%- if message['role'] not in ('user', 'assistant', 'tool') %}
{{- raise_exception('unknown role: ' + message['role']) }}
{%- endif %}
<|im_start|>{{ message['role'] }}
{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}
{%- for call in message.get('tool_calls', []) %}
<tool_call>
{"name": {{ call['function']['name'] | tojson }}, "arguments": {{ call['function']['arguments'] | tojson(indent=2) }}}
</tool_call>
{%- endfor %}{% endgeneration %}
{%- elif message['role'] == 'tool' %}<tool_response>
{{ message['content'] }}
</tool_response>
{%- else %}{{ message['content'] }}{% endif %}<|im_end|>
{% if loop.last and add_generation_prompt %}<|im_start|>assistant
{% endif %}
{%- endfor %}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file <of text> & return it",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]

CHATS: dict[str, list[dict[str, Any]]] = {
    "system and user": [
        {"role": "system", "content": "You edit code."},
        {"role": "user", "content": 'Rename x to total: ü 🙂 "quoted" <tag>'},
    ],
    "a turn back and forth": [
        {"role": "user", "content": "def add(a, b):"},
        {"role": "assistant", "content": "    return a + b"},
        {"role": "user", "content": "Now in two spaces."},
    ],
    "a tool call and its result": [
        {"role": "user", "content": "What is in setup.py?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "read_file", "arguments": {"path": "setup.py"}},
                }
            ],
        },
        {"role": "tool", "content": "from setuptools import setup"},
    ],
}


@pytest.fixture(scope="module")
def renderer():
    renderer = ChatRenderer(ChatTemplateSettings())
    yield renderer
    renderer.close()


@pytest.mark.parametrize(
    "template", [CHATML, DEMO_CHAT_TEMPLATE, HERMES_TOOLS], ids=["chatml", "demo", "hermes"]
)
@pytest.mark.parametrize("chat", CHATS, ids=str)
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no tools", "tools"])
@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["open", "closed"])
def test_a_template_renders_as_transformers_renders_it(
    renderer, template, chat, tools, add_generation_prompt
):
    tokenizer = bpe_tokenizer()
    tokenizer.chat_template = template
    expected = tokenizer.apply_chat_template(
        CHATS[chat], tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    rendered = renderer.render(
        template,
        CHATS[chat],
        add_generation_prompt=add_generation_prompt,
        variables=tokenizer.special_tokens_map,
        tools=tools,
    )
    assert rendered == expected


def test_a_checkpoint_renders_the_ids_transformers_renders(tmp_path):
    directory = write_tiny_checkpoint(tmp_path / "qwen3", "qwen3")
    (directory / "chat_template.jinja").write_text(HERMES_TOOLS)
    checkpoint = Checkpoint.open(directory)
    for chat in CHATS.values():
        assert checkpoint.render_chat(chat) == checkpoint.tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True, return_dict=False
        )


def test_the_templates_own_refusal_is_its_message(renderer):
    tokenizer = bpe_tokenizer()
    chat = [{"role": "wizard", "content": "hi"}]
    with pytest.raises(Exception, match="unknown role: wizard") as theirs:
        tokenizer.apply_chat_template(chat, chat_template=HERMES_TOOLS, tokenize=False)
    with pytest.raises(TemplateFailed) as ours:
        renderer.render(HERMES_TOOLS, chat, add_generation_prompt=True, variables={})
    assert str(ours.value) == str(theirs.value)


LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def test_a_renderer_killed_at_its_deadline_is_replaced_by_a_fresh_one():
    renderer = ChatRenderer(ChatTemplateSettings(timeout_s=1, renderers=1))
    chat = CHATS["system and user"]
    with pytest.raises(TemplateOverBound, match="longer than 1 s"):
        renderer.render(LOOP, chat, add_generation_prompt=True, variables={})
    assert renderer.render(CHATML, chat, add_generation_prompt=False, variables={}).startswith(
        "<|im_start|>system"
    )
    renderer.close()


# A process with two renderers, one idle and one spinning, killed -9 (well before its
# 5 s deadline, which would kill the spinning one itself): nothing closes or kills them for it.
ORPHANING = """
import os, sys, threading
from rtrl.chat_template import ChatRenderer, ChatTemplateSettings
renderer = ChatRenderer(ChatTemplateSettings(timeout_s=5, renderers=2))
threading.Thread(
    target=renderer.render, args=(sys.argv[1], []),
    kwargs={"add_generation_prompt": False, "variables": {}}, daemon=True,
).start()
renderer.render("hi", [], add_generation_prompt=False, variables={})
print(os.getpid(), flush=True)
threading.Event().wait()
"""


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid``, from each one's /proc stat."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_renderers_end_with_the_process_they_render_for_even_mid_render():
    """An idle renderer ends when its stdin closes; a spinning one by its own alarm
    (rtrl/chat_template_child.py)."""
    parent = subprocess.Popen(
        [sys.executable, "-c", ORPHANING, LOOP], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    renderers = until(
        lambda: _children(pid), "an idle and a spinning renderer", ready=lambda c: len(c) == 2
    )
    os.kill(pid, signal.SIGKILL)
    parent.wait()
    until(
        lambda: [p for p in renderers if _running(p)],
        "every renderer of the killed process ended",
        ready=lambda alive: not alive,
        timeout_s=60,
    )
