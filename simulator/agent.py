"""The agentic product's task: the same helpers (simulator/tasks.py), written by an agent
that may call tools before it answers.

The agent is offered four tools. None takes arguments; each acts on the task's file and
costs the editor time (the client sleeps that long before it answers the call):

    cfg    the user's editor configuration   0.4 s
    read   the file the helper goes into     0.4 s
    grep   the project's uses of the helper  0.6 s
    lint   the project's linter              0.8 s

Only the mixed project (p4), whose users each insist on a style of their own, has
anything to find, and only for the half of its users who write their style down
(simulator/users.py, ``written_style``): their editor configuration names their indent
(``indent 4``) and their file shows their quotes (``quote '``). Projects p0-p3 keep their
house style unwritten (``none``, ``new file``), so only feedback can teach it, as in the
single-turn product; grep finds nothing and lint passes everywhere. An agent that serves
p4 well reads both, in one turn (parallel calls cost the slowest, not the sum), and
answers the other projects directly. A p4 user who writes nothing down leaves any edit a
guess: the risky edit a policy may learn to dodge, by asking (reward r1) or by breaking a
call (a1h).

A tool call is a line ``!name`` in the policy's turn (the demo agent's chat template,
rtrl.checkpoint.AGENT_CHAT_TEMPLATE, teaches that syntax: inference/tool_calls.py's
"bang" family); several lines are parallel calls. A turn with calls ends the turn; the
tool's answer follows as ``=result``. The trajectory of a wasteful agent on p4:

    @p4 say hi 04821
    !cfg</s>=indent 4
    !read</s>=quote '
    !lint</s>=ok
    def say_hi_04821():
        print('hi')
    </s>

A misspelt call (``!raed``) is a broken call: the serving API answers a turn whose calls
are all broken as text, so the agent's harness shows that text and the user judges it as
the edit it is not.
"""

from __future__ import annotations

from dataclasses import dataclass

from rtrl.simulator.tasks import Style

CALL_MARK = "!"
RESULT_MARK = "="


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    latency_s: float
    """How long the editor takes to answer the call."""

    def openai(self) -> dict:
        """The tool as a chat request offers it."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {"type": "object", "properties": {}},
            },
        }


TOOLS = (
    Tool("cfg", "read the user's editor configuration", 0.4),
    Tool("read", "read the file the helper goes into", 0.4),
    Tool("grep", "search the project for uses of the helper", 0.6),
    Tool("lint", "run the project's linter", 0.8),
)
TOOL_NAMES = tuple(tool.name for tool in TOOLS)
BY_NAME = {tool.name: tool for tool in TOOLS}
MISSPELT = ("raed", "cgf", "lnit", "gerp")
"""Broken calls the warm start writes now and then (a call to no tool)."""
AGENT_MAX_TOKENS = 64
"""Budget of one turn: the longest helper with a serial and its end token take 51."""
MAX_TURNS = 8
"""The harness gives up on a trajectory after this many turns (the last one is a truncation)."""


def observe(tool: str, written: Style | None) -> str:
    """What ``tool`` answers for a user whose configuration and files show ``written`` (None:
    nothing, as in p0-p3: User.written_style)."""
    if tool == "cfg":
        return "none" if written is None else f"indent {written.indent}"
    if tool == "read":
        return "new file" if written is None else f"quote {written.quote}"
    if tool == "grep":
        return "0 hits"
    if tool == "lint":
        return "ok"
    raise KeyError(f"no tool {tool!r}")


def turn_latency_s(calls: list[str]) -> float:
    """The editor's time to answer one turn's calls: they run in parallel."""
    return max((BY_NAME[name].latency_s for name in calls), default=0.0)


def render_calls(calls: list[str]) -> str:
    """A turn of calls as the policy writes it."""
    return "".join(f"{CALL_MARK}{name}\n" for name in calls)


def render_result(text: str) -> str:
    """A tool's answer as the chat template renders it."""
    return f"{RESULT_MARK}{text}\n"
