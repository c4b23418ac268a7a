"""What every `rtrl` command shares: where output goes, the stack it acts on, exit codes.

Output: tables and progress for people go to stdout; what the CLI says about itself (which
stack, which Redis) goes to stderr; with ``--json`` stdout carries one JSON document and
nothing else. A table is never cut to fit: when stdout is not a terminal (``make demo >
log``, a pipe) and ``COLUMNS`` is unset, the console is as wide as the widest table needs,
instead of rich's default of 80 columns.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

import typer
from rich.console import Console

OK, FAILED, USAGE = 0, 1, 2
EXIT_CODES = {
    OK: "done: the command did what it was asked.",
    FAILED: "could not: no stack running, the stack failed to start, no such key, no data to "
    "report, a demo without its result.",
    USAGE: "bad usage or input: an unknown option or value (click's usage errors exit 2 "
    "too), an invalid scope or budget, an unknown model family.",
}
"""What each exit code of every `rtrl` command means (docs/cli.md)."""

UNCUT_WIDTH = 10_000
"""The console's width off a terminal: wider than any table. Tables and text take only the
width they need (nothing here expands to the console's width)."""


def make_console(stream: TextIO, **kwargs: Any) -> Console:
    """A console on ``stream`` that never cuts a table when ``stream`` is not a terminal."""
    on_terminal = stream.isatty()
    width = None if on_terminal or "COLUMNS" in os.environ else UNCUT_WIDTH
    return Console(file=stream, width=width, **kwargs)


class _Stream:
    """sys.stdout or sys.stderr looked up at each write, so a test's captured stream is used."""

    def __init__(self, name: str) -> None:
        self._name = name

    def write(self, text: str) -> int:
        return getattr(sys, self._name).write(text)

    def flush(self) -> None:
        getattr(sys, self._name).flush()

    def isatty(self) -> bool:
        return getattr(sys, self._name).isatty()


console = make_console(_Stream("stdout"))  # type: ignore[arg-type]
err_console = make_console(_Stream("stderr"), soft_wrap=True)  # type: ignore[arg-type]

JSON_OPTION = typer.Option(
    False, "--json", help="Print one JSON document on stdout instead of tables (for scripts)."
)


def print_json(document: Any) -> None:
    print(json.dumps(document, indent=1, default=str))


def state_dir() -> Path:
    from rtrl.config import StackSettings

    return StackSettings().state_dir.resolve()


def require_stack():
    from rtrl.ops.health import running_stack

    stack = running_stack(state_dir())
    if stack is None:
        err_console.print("[red]no stack running[/]: start one with `rtrl up`")
        raise typer.Exit(FAILED)
    return stack
