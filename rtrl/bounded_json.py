"""JSON from a client or a model, read within a nesting bound.

Python's ``json`` parser recurses once per array or object, so a few hundred kilobytes of
``[[[[…`` exhaust its stack: a RecursionError, which every door answered with a 500 (the
serving API's tool-call arguments, the gateway's batches, the sink's ``/query``). So JSON
that a client sent or a model wrote is held to ``MAX_JSON_DEPTH`` before anything
recursive reads it, and refused past it with ``JsonTooDeep``: a ``json.JSONDecodeError``,
so each door answers it as the 400 of text that is not the JSON it reads, and a tool call
that a model wrote that deep is an invalid call like any other broken JSON.

Two ways to the same bound: ``loads`` parses with pydantic-core's parser (Rust, not
recursive in Python, and it stops past 201 levels itself), the one the serving API's bodies
already go through; ``check_depth`` measures a text that the standard library will parse
(a streamed tool call's ``raw_decode``) without recursing.

The bound is a property of the format rather than of a deployment, like the sink's literal
caps: no tool's arguments, event batch or query body nests anywhere near 200 levels, and
that is far below what the standard library's parser and ``json.dumps`` need of Python's
stack (about one frame per level, of 1,000).
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

import pydantic_core

MAX_JSON_DEPTH = 201
"""Arrays and objects nested in one JSON text that a client or a model wrote: the deepest
pydantic-core's parser reads, so every door holds JSON to the same bound."""

# A string literal (its brackets are text), or a run of anything but brackets and quotes.
_NOT_NESTING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[^\[\]{}"]+', re.DOTALL)
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1, '"': 0}
_PARSER_TOO_DEEP = "recursion limit exceeded"


class NotJson(json.JSONDecodeError):
    """Text that is not JSON, or not JSON within the bound; the message is the reason alone."""

    def __init__(self, reason: str, doc: str) -> None:
        super().__init__(reason, doc, 0)
        self.args = (reason,)

    def __str__(self) -> str:
        return self.msg


class JsonTooDeep(NotJson):
    """The text nests arrays and objects deeper than MAX_JSON_DEPTH."""

    def __init__(self, deepest: int | None, doc: str) -> None:
        levels = f"{deepest} levels" if deepest is not None else "too"
        super().__init__(f"nested {levels} deep, at most {MAX_JSON_DEPTH} allowed", doc)


def check_depth(text: str) -> None:
    """Raise JsonTooDeep if ``text`` nests deeper than MAX_JSON_DEPTH. Linear in the text
    and never recursive; text that is not JSON at all is left for its parser to refuse."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return
    brackets = _NOT_NESTING.sub("", text)
    deepest = max(accumulate(map(_STEP.__getitem__, brackets)), default=0)
    if deepest > MAX_JSON_DEPTH:
        raise JsonTooDeep(deepest, text)


def loads(data: str | bytes) -> Any:
    """The value of JSON a client sent, exactly as ``json.loads`` gives it, and its errors
    for text that is not JSON; JsonTooDeep for JSON nested past MAX_JSON_DEPTH. The fast
    parser reads the text; only text it refuses is read again by the standard library (for
    its usual message, or its value where the two differ), after ``check_depth``."""
    try:
        return pydantic_core.from_json(data)
    except ValueError as exc:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        if str(exc).startswith(_PARSER_TOO_DEEP):
            raise JsonTooDeep(None, text) from None
    check_depth(text)
    return json.loads(text)
