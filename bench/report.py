"""What every benchmark does with its result: a frozen dataclass, written as JSON to
bench/results/<name>.json (its fields, nested dataclasses as objects) and returned."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, TypeVar

Result = TypeVar("Result")


def write(out: Path, result: Result) -> Result:
    """Write ``result`` (a dataclass instance) to ``out`` as JSON and return it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(as_json(result), indent=2) + "\n")
    return result


def as_json(result: Any) -> dict[str, Any]:
    if not dataclasses.is_dataclass(result) or isinstance(result, type):
        raise TypeError(f"a bench result is a dataclass instance, not {type(result).__name__}")
    return dataclasses.asdict(result)
