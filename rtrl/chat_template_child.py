"""The chat-template renderer's own process: ``python -I chat_template_child.py MEMORY_MB``.

A Jinja render cannot be stopped from outside its thread: a loop that prints nothing, or
one expression computed in C (``10 ** (10 ** 8)``, folded while the template compiles), runs
until it ends. So templates are rendered here, in a process the parent kills at its
deadline (rtrl/chat_template.py). This process also bounds itself: its address space is
capped at MEMORY_MB, and each render arms SIGALRM, whose default action ends the process,
in case the parent is gone and cannot kill it.

It renders exactly as transformers' ``apply_chat_template(..., tokenize=False)`` does
(transformers.utils.chat_template_utils): the same immutable sandbox, trim_blocks and
lstrip_blocks, loop controls, the ``{% generation %}`` tag, the ``tojson`` filter and the
``raise_exception`` and ``strftime_now`` globals, the same variables. It imports only the
standard library and jinja2, and runs isolated (``-I``), so nothing of the parent's
environment or working directory reaches it.

Frames, both ways: a 4-byte big-endian length, then that many bytes of JSON. After start
it says ``{"ready": true}``; then, for each request ``{"template", "messages", "tools",
"add_generation_prompt", "variables", "max_chars", "timeout_s"}``, it answers ``{"text"}``,
``{"over": "max_chars" | "max_memory_mb"}`` or ``{"error"}``. Stdin closing ends it.
"""

from __future__ import annotations

import functools
import json
import resource
import signal
import struct
import sys
from collections.abc import Iterator
from datetime import datetime
from typing import Any, BinaryIO

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

HEADER = struct.Struct(">I")


class GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks the assistant's tokens
    with it; rendering text, it is its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: jinja2.runtime.Macro) -> str:
        return str(caller())


def raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Not Jinja's own tojson, which escapes HTML characters.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=16)
def compiled(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


def pieces(request: dict[str, Any]) -> Iterator[str]:
    """The rendering, piece by piece as Jinja produces it, with transformers' variables:
    the special tokens' names first, overridden by the chat's own."""
    return compiled(request["template"]).generate(
        messages=request["messages"],
        tools=request["tools"],
        documents=None,
        add_generation_prompt=request["add_generation_prompt"],
        **request["variables"],
    )


def render(request: dict[str, Any]) -> dict[str, Any]:
    limit, count, text = request["max_chars"], 0, []
    for piece in pieces(request):
        count += len(piece)
        if count > limit:
            return {"over": "max_chars"}
        text.append(piece)
    return {"text": "".join(text)}


def answer(request: dict[str, Any]) -> dict[str, Any]:
    signal.setitimer(signal.ITIMER_REAL, 2 * request["timeout_s"] + 5)
    try:
        return render(request)
    except MemoryError:
        return {"over": "max_memory_mb"}
    except Exception as exc:  # the template's own failure, told to the caller
        return {"error": str(exc) or type(exc).__name__}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def read(stream: BinaryIO) -> dict[str, Any] | None:
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    body: dict[str, Any] = json.loads(stream.read(size))
    return body


def write(stream: BinaryIO, reply: dict[str, Any]) -> None:
    body = json.dumps(reply).encode()  # ASCII: a lone surrogate in a message travels too
    stream.write(HEADER.pack(len(body)) + body)
    stream.flush()


def main() -> None:
    memory = int(sys.argv[1]) << 20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the parent's to handle
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    write(stdout, {"ready": True})
    while (request := read(stdin)) is not None:
        write(stdout, answer(request))


if __name__ == "__main__":
    main()
