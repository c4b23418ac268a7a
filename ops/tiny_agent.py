"""A tiny agent checkpoint: a random Qwen3 taught, on the spot, to play given agent scripts
(tool calls in Qwen3's Hermes syntax, several in parallel, then an answer), with a
Qwen3-style chat template that renders tools, calls and tool results and strips earlier
turns' ``<think>`` blocks as Qwen3's does.

Real agents come from a model hub, which this machine does not have; a random model never
writes a well-formed tool call. So a few hundred optimizer steps make a tiny one memorize
each script's assistant turns, on exactly the ids the serving API will show it: the first
prompt rendered by the template, then each turn's sampled ids and the ids of what it
observes after them, as inference/sessions.py appends them (token in, token out). Served
at temperature 1 with a seed, it plays the script back; served anything else, it says
what a random model says.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from rtrl.checkpoint import Checkpoint
from rtrl.inference.sessions import continuation_ids
from rtrl.ops.tiny_model import EOS_ID, bpe_tokenizer, tiny_config

TOOL_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions.\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each call, return a JSON object within <tool_call></tool_call> "
    'tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n'
    "</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}"
    "{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and reasoning %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- set call = tool_call.function if tool_call.function else tool_call %}"
    "{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' + call.name + \'", "arguments": \' }}'
    "{%- if call.arguments is string %}{{- call.arguments }}"
    "{%- else %}{{- call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen3's chat template, in short: tools in the system turn, calls as Hermes blocks,
consecutive tool results in one user turn, reasoning kept only after the last query."""

AGENT_TOKENS = (
    *("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
    *("<think>", "</think>"),
)


@dataclass(frozen=True)
class Script:
    """An agent run to teach: the messages before its first turn, then each assistant
    turn as the policy writes it (raw text: calls in Hermes syntax) and the messages it
    observes after it (tool results, the user's next message)."""

    opening: tuple[Mapping[str, Any], ...]
    turns: tuple[tuple[str, tuple[Mapping[str, Any], ...]], ...]
    tools: tuple[Mapping[str, Any], ...] = ()


@dataclass
class Taught:
    steps: int
    min_prob: float
    """The smallest probability the taught model gives a script's token (temperature 1)."""
    tokens: list[int] = field(default_factory=list)
    """Each script's length in tokens."""


def function_tool(name: str, description: str, **parameters: str) -> dict[str, Any]:
    """An OpenAI function tool with string parameters."""
    properties = {p: {"type": "string", "description": d} for p, d in parameters.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": list(parameters),
            },
        },
    }


def write_tiny_agent(
    out_dir: Path,
    scripts: Sequence[Script],
    *,
    seed: int = 0,
    max_positions: int = 4096,
    min_prob: float = 0.9995,
    max_steps: int = 3000,
) -> Taught:
    """Save a tiny Qwen3 that plays ``scripts`` back to ``out_dir``; the report says how
    sure it is. Raises RuntimeError if it has not learned them within ``max_steps``."""
    tokenizer = bpe_tokenizer(512)
    tokenizer.add_tokens(list(AGENT_TOKENS))
    tokenizer.chat_template = TOOL_TEMPLATE
    config = tiny_config("qwen3", len(tokenizer), max_positions)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    policy = Checkpoint.open(out_dir)
    sequences = [script_ids(policy, script) for script in scripts]
    taught = _teach(model, sequences, min_prob, max_steps)
    model.save_pretrained(out_dir, safe_serialization=True)
    return taught


def script_ids(policy: Checkpoint, script: Script) -> tuple[list[int], list[bool]]:
    """A script's ids as the serving API builds them turn by turn, and which are the
    policy's (the turns it is taught to write)."""
    tools = list(script.tools)
    ids = policy.render_chat(list(script.opening), tools)
    taught = [False] * len(ids)
    for text, observed in script.turns:
        turn = [*policy.tokenize(text), EOS_ID]
        ids += turn
        taught += [True] * len(turn)
        if observed:
            added = continuation_ids(policy, EOS_ID, list(observed), tools)
            ids += added
            taught += [False] * len(added)
    return ids, taught


def _teach(
    model: torch.nn.Module,
    sequences: list[tuple[list[int], list[bool]]],
    min_prob: float,
    max_steps: int,
) -> Taught:
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    model.train()
    worst = 0.0
    for step in range(1, max_steps + 1):
        optimizer.zero_grad()
        worst = 1.0
        for ids, taught in sequences:
            inputs = torch.tensor([ids])
            logits = model(input_ids=inputs).logits[0, :-1].float()
            targets = inputs[0, 1:]
            mask = torch.tensor(taught[1:])
            logp = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0][mask]
            (-logp.sum() / mask.sum()).backward()
            worst = min(worst, math.exp(logp.min().item()))
        optimizer.step()
        if worst >= min_prob:
            model.eval()
            return Taught(step, worst, [len(ids) for ids, _ in sequences])
    raise RuntimeError(f"the tiny agent did not learn its scripts in {max_steps} steps ({worst})")
