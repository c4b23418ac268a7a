"""The generated reference docs: ``docs/configuration.md`` from the pydantic-settings
classes, ``docs/topics.md`` from rtrl/topics.py and the code that creates topics, and
``docs/cli.md`` from the `rtrl` command line's typer app.

    python -m rtrl.ops.docgen           # write the three files
    python -m rtrl.ops.docgen --check   # exit 1 naming each stale file (CI, tests/ops/test_docs.py)

Nothing is listed by hand except the order and titles of the sections: settings
classes are found by scanning the service packages for ``SettingsConfigDict``, fields and
their constraints come from pydantic, and the docstring under each field is read from
the source with ``ast`` (pydantic only keeps it as the description when a class sets
``use_attribute_docstrings``). A field or a class added anywhere appears on the next run.

The package is split by output: ``configuration`` renders docs/configuration.md,
``topics`` renders docs/topics.md, and ``_common`` holds what both use.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from ._common import (
    GENERATED,
    REPO,
    SKIPPED,
    anchor,
    cell,
    module_name,
    service_sources,
)
from .cli import render_cli
from .configuration import (
    SECTIONS,
    FieldDoc,
    SettingsDoc,
    render_configuration,
    settings_classes,
    settings_docs,
)
from .topics import render_tables, render_topics

__all__ = [
    "CLI",
    "CONFIGURATION",
    "GENERATED",
    "REPO",
    "SECTIONS",
    "SKIPPED",
    "TOPICS",
    "FieldDoc",
    "SettingsDoc",
    "anchor",
    "cell",
    "main",
    "module_name",
    "render",
    "render_cli",
    "render_configuration",
    "render_tables",
    "render_topics",
    "service_sources",
    "settings_classes",
    "settings_docs",
    "stale",
]

CONFIGURATION = Path("docs/configuration.md")
TOPICS = Path("docs/topics.md")
CLI = Path("docs/cli.md")


def render() -> dict[Path, str]:
    """Repository-relative path -> the file's generated text."""
    docs = settings_docs()
    return {
        CONFIGURATION: render_configuration(docs),
        TOPICS: render_topics(docs),
        CLI: render_cli(),
    }


def stale(generated: dict[Path, str]) -> list[Path]:
    return [
        path
        for path, text in generated.items()
        if not (REPO / path).exists() or (REPO / path).read_text(encoding="utf-8") != text
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rtrl.ops.docgen", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if a generated file differs from the code",
    )
    args = parser.parse_args()
    generated = render()
    if args.check:
        outdated = stale(generated)
        for path in outdated:
            current = (
                (REPO / path).read_text(encoding="utf-8").splitlines()
                if (REPO / path).exists()
                else []
            )
            diff = list(
                difflib.unified_diff(
                    current,
                    generated[path].splitlines(),
                    str(path),
                    f"{path} (from the code)",
                    lineterm="",
                )
            )
            print(
                f"{path} is stale: run `python -m rtrl.ops.docgen` and commit it", file=sys.stderr
            )
            print("\n".join(diff[:60]) + ("\n…" if len(diff) > 60 else ""), file=sys.stderr)
        raise SystemExit(1 if outdated else 0)
    for path, text in generated.items():
        (REPO / path).parent.mkdir(parents=True, exist_ok=True)
        (REPO / path).write_text(text, encoding="utf-8")
        print(f"wrote {path}")
