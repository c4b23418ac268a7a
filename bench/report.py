"""What every benchmark does with its result: a frozen dataclass, written as JSON to
bench/results/<name>.json (its fields, nested dataclasses as objects) and returned, with
the commit it measured (the code changes under a benchmark, so a figure names its code)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path
from typing import Any, TypeVar

Result = TypeVar("Result")
REPO = Path(__file__).resolve().parent.parent


def write(out: Path, result: Result) -> Result:
    """Write ``result`` (a dataclass instance) to ``out`` as JSON and return it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(as_json(result), indent=2) + "\n")
    return result


def as_json(result: Any) -> dict[str, Any]:
    if not dataclasses.is_dataclass(result) or isinstance(result, type):
        raise TypeError(f"a bench result is a dataclass instance, not {type(result).__name__}")
    return dataclasses.asdict(result)


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO, capture_output=True, text=True, check=False
    ).stdout.strip()


def code_version(watched: str = "reward_stream") -> str:
    """The commit measured (``+dirty`` when ``watched`` differs from it; empty outside a
    git checkout)."""
    head = _git("rev-parse", "--short", "HEAD")
    return f"{head}+dirty" if head and _git("status", "--porcelain", "--", watched) else head


def provenance() -> tuple[str, bool]:
    """The commit measured, and whether tracked files differed from it."""
    return (
        _git("rev-parse", "--short", "HEAD"),
        bool(_git("status", "--porcelain", "--untracked-files=no")),
    )
