"""Tool calls parsed from what the policy wrote, in its chat template's own syntax.

A model calls tools in the syntax its chat template teaches it. The Hermes family (Qwen2.5,
Qwen3 and the many models trained on Hermes-style data) writes each call as a JSON object
between tags, several in one turn when it calls in parallel:

    Let me read both.
    <tool_call>
    {"name": "read_file", "arguments": {"path": "a.py"}}
    </tool_call>
    <tool_call>
    {"name": "read_file", "arguments": {"path": "b.py"}}
    </tool_call>

No call is ever dropped. A call to a tool the request did not offer, arguments that are not
a JSON object, text after the object, a block the generation ended inside: each is still a
call, marked invalid with the reason. A broken call that vanished would be the reward hack
Cursor met: it would end the rollout without the negative reward a broken call earns.

The demo agent's template teaches a terser syntax, the "bang" family (BANG_MARK in the
template selects it): a call is a line of its own, ``!name`` or ``!name {"arg": ...}``,
and several such lines are parallel calls. A line that begins with ``!`` is always a call,
valid or not; ``!`` anywhere else is text.

``parser`` gives each family's streaming parser. Either gives the same calls and text
whatever pieces the text arrives in (tests/inference/test_tool_calls.py splits every case
at every point); ``parse`` is one fed the whole text at once.

JSON nested past rtrl/bounded_json.py's bound is broken JSON too: the call is invalid,
the parser never recurses that deep.

A Hermes block closes at the first ``</tool_call>`` after which its JSON is complete, so
a literal ``</tool_call>`` inside an argument's string does not cut the call short; a block
whose JSON is broken before its end closes at its first tag.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from rtrl.bounded_json import check_depth

OPEN, CLOSE = "<tool_call>", "</tool_call>"
BANG_MARK = "rtrl-tool-calls: bang"
"""A chat template holding this text (in a comment) teaches the bang family."""
_DECODER = json.JSONDecoder()
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class ParsedCall:
    name: str
    """"" when the block names none."""
    arguments_json: str
    """The arguments as a JSON object's text, for the client (OpenAI's ``arguments``);
    the block as written when they are not one."""
    valid: bool
    error: str = ""


@dataclass(frozen=True)
class Text:
    """Text outside any call, in order: the turn's ``content``."""

    text: str


@dataclass(frozen=True)
class Call:
    """A call, once its block has closed (or the generation ended inside it)."""

    index: int
    """Among the turn's calls, from 0."""
    call: ParsedCall


Event = Text | Call


@dataclass(frozen=True)
class Parsed:
    content: str
    """All the text outside the calls, as written (whitespace around the tags included)."""
    calls: tuple[ParsedCall, ...]


def family_of(chat_template: str) -> str | None:
    """The tool-call syntax a chat template teaches: "bang" or "hermes", or None when it
    teaches none this module parses (its turns are then text alone)."""
    if BANG_MARK in chat_template:
        return "bang"
    return "hermes" if OPEN in chat_template and CLOSE in chat_template else None


def parser(family: str, tools: Collection[str] | None) -> StreamingParser | BangParser:
    """A streaming parser of ``family``'s syntax (family_of)."""
    if family == "bang":
        return BangParser(tools)
    if family == "hermes":
        return StreamingParser(tools)
    raise ValueError(f"no tool-call family {family!r}")


def parse(text: str, tools: Collection[str] | None, family: str = "hermes") -> Parsed:
    """A whole turn's text: its content and its calls. ``tools``: the names the request
    offered (None: it offered none, and any call is invalid)."""
    stream = parser(family, tools)
    events = stream.feed(text) + stream.finish()
    return Parsed(
        content="".join(e.text for e in events if isinstance(e, Text)),
        calls=tuple(e.call for e in events if isinstance(e, Call)),
    )


class StreamingParser:
    """One turn's text in the Hermes syntax, piece by piece: ``feed`` each piece, then
    ``finish`` once."""

    def __init__(self, tools: Collection[str] | None) -> None:
        self._tools = tools
        self._buffer = ""
        self._inside = False
        """The buffer holds a block's text after its opening tag."""
        self._calls = 0

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while True:
            if not self._inside:
                start = self._buffer.find(OPEN)
                if start < 0:
                    keep = _partial_tag(self._buffer)
                    self._emit_text(self._buffer[: len(self._buffer) - keep], events)
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return events
                self._emit_text(self._buffer[:start], events)
                self._buffer = self._buffer[start + len(OPEN) :]
                self._inside = True
            end = _block_end(self._buffer, final=False)
            if end is None:
                return events
            self._close(end, events)

    def finish(self) -> list[Event]:
        """What is left when the generation ends: held-back text, and a block still open
        (closed at its first tag if it has one, else unterminated)."""
        events: list[Event] = []
        while self._inside:
            end = _block_end(self._buffer, final=True)
            if end is None:
                events.append(Call(self._calls, self._unterminated()))
                self._calls += 1
                self._buffer, self._inside = "", False
                return events
            self._close(end, events)
            events.extend(self.feed(""))
        self._emit_text(self._buffer, events)
        self._buffer = ""
        return events

    def _close(self, end: int, events: list[Event]) -> None:
        events.append(Call(self._calls, self._call(self._buffer[:end])))
        self._calls += 1
        self._buffer = self._buffer[end + len(CLOSE) :]
        self._inside = False

    @staticmethod
    def _emit_text(text: str, events: list[Event]) -> None:
        if text:
            events.append(Text(text))

    def _unterminated(self) -> ParsedCall:
        name = _name_of(self._buffer)
        return ParsedCall(
            name, self._buffer, False, f"the generation ended inside the call ({OPEN} unclosed)"
        )

    def _call(self, block: str) -> ParsedCall:
        """A closed block's call, valid or with the reason it is not."""
        body = block.strip()
        try:
            check_depth(body)
            value, end = _DECODER.raw_decode(body)
        except json.JSONDecodeError as exc:
            return ParsedCall(_name_of(body), block, False, f"the call is not JSON: {exc}")
        if end != len(body):
            return ParsedCall(_name_of(body), block, False, "text after the call's JSON object")
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return ParsedCall("", block, False, 'the call is not an object with a "name"')
        name: str = value["name"]
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the object as a JSON string
            try:
                check_depth(arguments)
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            return ParsedCall(name, block, False, "the arguments are not a JSON object")
        return _offered(name, arguments, self._tools)


def _offered(name: str, arguments: dict[str, Any], tools: Collection[str] | None) -> ParsedCall:
    """A well-formed call: valid when the request offered its tool."""
    arguments_json = json.dumps(arguments, ensure_ascii=False)
    if tools is None:
        return ParsedCall(name, arguments_json, False, "the request offered no tools")
    if name not in tools:
        offered = ", ".join(sorted(tools)) or "none"
        return ParsedCall(name, arguments_json, False, f"no tool {name!r} (offered: {offered})")
    return ParsedCall(name, arguments_json, True)


class BangParser:
    """One turn's text in the bang syntax (the module's docstring), piece by piece: ``feed``
    each piece, then ``finish`` once. Text is passed on as soon as its line cannot be a call;
    a line that begins with ``!`` is held until its newline (or the generation's end)."""

    def __init__(self, tools: Collection[str] | None) -> None:
        self._tools = tools
        self._line = ""
        """The current line, while it may be a call (it begins with ``!``, or is empty)."""
        self._text_line = False
        """The current line is text: it began with something else."""
        self._calls = 0

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        while text:
            cut = text.find("\n")
            piece, text = (text, "") if cut < 0 else (text[: cut + 1], text[cut + 1 :])
            if self._text_line:
                StreamingParser._emit_text(piece, events)
            else:
                self._line += piece
                if not self._line.startswith("!"):
                    StreamingParser._emit_text(self._line, events)
                    self._text_line, self._line = True, ""
                elif self._line.endswith("\n"):
                    self._close(self._line[:-1], events)
            if piece.endswith("\n"):
                self._text_line = False
        return events

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self._line:
            self._close(self._line, events)
        return events

    def _close(self, line: str, events: list[Event]) -> None:
        events.append(Call(self._calls, self._call(line[1:])))
        self._calls += 1
        self._line = ""

    def _call(self, body: str) -> ParsedCall:
        head, _, rest = body.partition(" ")
        if _NAME.fullmatch(head) is None:
            return ParsedCall("", body, False, "the call names no tool")
        if not rest.strip():
            return _offered(head, {}, self._tools)
        try:
            check_depth(rest)
            arguments = json.loads(rest)
        except json.JSONDecodeError as exc:
            return ParsedCall(head, rest, False, f"the arguments are not JSON: {exc}")
        if not isinstance(arguments, dict):
            return ParsedCall(head, rest, False, "the arguments are not a JSON object")
        return _offered(head, arguments, self._tools)


def _partial_tag(text: str) -> int:
    """How many of the text's last characters could begin an opening tag: held back."""
    for keep in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-keep:]):
            return keep
    return 0


def _block_end(block: str, *, final: bool) -> int | None:
    """Where the block's closing tag starts, or None while it cannot be told yet.

    Each ``</tool_call>`` in turn: the block ends at the first one after which its JSON is
    complete. JSON broken before the tag (not merely cut short by it) can never complete:
    the block ends at its first tag. JSON every tag cuts short may be completed by more
    text, so the end waits for it, unless ``final``: then the first tag."""
    first = block.find(CLOSE)
    at = first
    while at >= 0:
        status = _json_status(block[:at])
        if status == "complete":
            return at
        if status == "broken":
            return first
        at = block.find(CLOSE, at + 1)
    return first if final and first >= 0 else None


def _json_status(text: str) -> str:
    """ "complete" when ``text`` is one JSON value (whitespace around it), "cut" when more text
    could still make it one, "broken" when nothing after it can."""
    body = text.strip()
    try:
        check_depth(body)
        _, end = _DECODER.raw_decode(body)
    except json.JSONDecodeError as exc:
        cut = exc.msg.startswith("Unterminated string") or exc.pos >= len(body)
        return "cut" if cut else "broken"
    return "complete" if end == len(body) else "broken"


def _name_of(text: str) -> str:
    """The name a broken call was after, when its text shows one (for the reward's and the
    monitors' sake); "" otherwise."""
    marker = '"name"'
    at = text.find(marker)
    if at < 0:
        return ""
    rest = text[at + len(marker) :].lstrip().removeprefix(":").lstrip()
    if not rest.startswith('"'):
        return ""
    try:
        name, _ = _DECODER.raw_decode(rest)
    except json.JSONDecodeError:
        return ""
    return name if isinstance(name, str) else ""
