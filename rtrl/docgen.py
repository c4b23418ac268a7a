"""The generated reference docs: ``docs/configuration.md`` from the pydantic-settings
classes and ``docs/topics.md`` from rtrl/topics.py and the code that creates topics.

    python -m rtrl.docgen           # write both files
    python -m rtrl.docgen --check   # exit 1 naming each stale file (CI, tests/test_docs.py)

Nothing is listed by hand except the order and titles of the sections: settings
classes are found by scanning the service packages for ``BaseSettings``, fields and
their constraints come from pydantic, and the docstring under each field is read from
the source with ``ast`` (pydantic only keeps it as the description when a class sets
``use_attribute_docstrings``). A field or a class added anywhere appears on the next run.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import enum
import fnmatch
import importlib
import inspect
import json
import os
import re
import sys
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePath

REPO = Path(__file__).resolve().parent.parent
CONFIGURATION = Path("docs/configuration.md")
TOPICS = Path("docs/topics.md")
# Not service code: tests, generated protobuf, benchmarks, scripts and this generator.
SKIPPED = ("tests/*", "rtrl/v1/*", "bench/*", "rtrl/bench_*", "scripts/*", "rtrl/docgen.py")

# Section order and who reads each class. A class not named here still gets a
# section (titled by its name) after these, so a new one is never left out.
SECTIONS = {
    "rtrl.config.StackSettings": ("Shared connections", "every service, the `rtrl` CLI and the supervisor"),
    "rtrl.stack.StackConfig": ("Embedded stack", "`rtrl up`, `rtrl demo` and the supervisor they start (not the services)"),
    "ingest.config.IngestSettings": ("Ingest gateway", "`python -m ingest`"),
    "reward_stream.config.RewardStreamSettings": ("Reward stream", "`python -m reward_stream`, and `python -m reward_stream.replay` for its join window"),
    "trainer.config.TrainerSettings": ("Trainer", "`python -m trainer`, and every rank of `torchrun … -m trainer`"),
    "weight_sync.config.WeightSyncSettings": ("Weight sync server", "`python -m weight_sync`"),
    "weight_sync.relay.RelaySettings": ("Weight sync relay", "`python -m weight_sync.relay`"),
    "inference.config.InferenceSettings": ("Inference worker", "`python -m inference`"),
    "inference.sglang_sidecar.SidecarSettings": ("SGLang sidecar", "`python -m inference.sglang_sidecar`"),
    "analytics.config.AnalyticsSettings": ("Analytics sink", "`python -m analytics`"),
}


# Produced by settings_docs; consumed by render_configuration.
@dataclass(frozen=True)
class FieldDoc:
    name: str
    env_names: tuple[str, ...]
    type: str
    default: str
    constraints: str
    description: str


@dataclass(frozen=True)
class SettingsDoc:
    qualname: str
    """``module.Class``."""
    path: str
    """Source file, relative to the repository."""
    title: str
    read_by: str
    env_prefix: str
    summary: str
    fields: tuple[FieldDoc, ...]
    checks: tuple[str, ...]
    """Messages of the ValueErrors its validators raise: what a bad value fails with at start-up."""


# ---- finding the settings classes ------------------------------------------------------


def service_sources() -> Iterator[Path]:
    """Every Python file of the service packages, in a stable order."""
    for directory, subdirectories, files in os.walk(REPO):
        here = Path(directory)
        # Pruned in place so os.walk never descends into .venv, .git or the state dir.
        subdirectories[:] = sorted(
            d for d in subdirectories if not d.startswith((".", "__")) and not d.endswith(".egg-info") and not _skipped(here / d)
        )
        for name in sorted(files):
            if name.endswith(".py") and not _skipped(here / name):
                yield here / name


def _skipped(path: Path) -> bool:
    relative = path.relative_to(REPO).as_posix()
    return any(fnmatch.fnmatch(relative, pattern) or fnmatch.fnmatch(relative + "/", pattern) for pattern in SKIPPED)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def settings_classes() -> list[type]:
    """Every BaseSettings subclass defined in the service packages, in section order."""
    from pydantic_settings import BaseSettings

    modules = {module_name(path) for path in service_sources() if "BaseSettings" in path.read_text(encoding="utf-8")}
    for name in sorted(modules):
        importlib.import_module(name)
    found: dict[str, type] = {}
    pending = list(BaseSettings.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls.__module__ in modules:
            found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    order = list(SECTIONS)
    return [found[q] for q in sorted(found, key=lambda q: (order.index(q) if q in order else len(order), q))]


# ---- one field ---------------------------------------------------------------------------

_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean"}


def _is_none(annotation) -> bool:
    return annotation is type(None)


def type_text(annotation) -> str:
    """What to write in the variable, in words."""
    from pydantic import SecretBytes, SecretStr

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return "string" if all(isinstance(a, str) for a in args) else "one of the choices"
    if origin in (typing.Union, types.UnionType):
        kinds = " or ".join(type_text(a) for a in args if not _is_none(a))
        return f"{kinds} (optional)" if any(_is_none(a) for a in args) else kinds
    if origin in (tuple, list, set, frozenset):
        items = [a for a in args if a is not Ellipsis]
        return f"JSON list of {type_text(items[0]) if items else 'values'}"
    if origin is dict:
        return "JSON object"
    if annotation in (SecretStr, SecretBytes):
        return "secret string"
    if isinstance(annotation, type) and issubclass(annotation, PurePath):
        return "path"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "string"
    if annotation in _SCALARS:
        return _SCALARS[annotation]
    return getattr(annotation, "__name__", str(annotation))


def _choices(annotation) -> tuple:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return args
    if origin in (typing.Union, types.UnionType):
        return tuple(choice for a in args for choice in _choices(a))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return tuple(member.value for member in annotation)
    return ()


def _is_secret(annotation) -> bool:
    from pydantic import SecretBytes, SecretStr

    if annotation in (SecretStr, SecretBytes):
        return True
    return any(_is_secret(a) for a in typing.get_args(annotation))


def _size(value: int) -> str:
    """`` (3 MiB)`` for a whole number of KiB/MiB/GiB, else nothing."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= scale and value % scale == 0:
            return f" ({value // scale} {unit})"
    return ""


def _number(value, name: str) -> str:
    text = f"`{value!r}`"
    return text + _size(value) if name.endswith("_bytes") and isinstance(value, int) else text


def default_text(name: str, field) -> str:
    """The default as it would be written in the environment."""
    from pydantic_core import PydanticUndefined

    if field.is_required():
        return "(required)"
    if _is_secret(field.annotation):
        return "(secret)"
    if field.default_factory is not None or field.default is PydanticUndefined:
        return "(computed at start-up)"
    value = field.default
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, str):
        return f"`{value}`" if value else "(empty)"
    if isinstance(value, PurePath):
        return f"`{value.as_posix()}`"
    if isinstance(value, (tuple, list, set, frozenset)):
        return f"`{json.dumps(sorted(value) if isinstance(value, (set, frozenset)) else list(value))}`"
    if isinstance(value, (int, float)):
        return _number(value, name)
    return f"`{value}`"


def constraints_text(name: str, field) -> str:
    import annotated_types as at

    parts = []
    for item in field.metadata:
        for kind, attribute, symbol in ((at.Gt, "gt", ">"), (at.Ge, "ge", "≥"), (at.Lt, "lt", "<"), (at.Le, "le", "≤")):
            if isinstance(item, kind):
                parts.append(f"{symbol} {_number(getattr(item, attribute), name)}")
        if isinstance(item, at.MultipleOf):
            parts.append(f"multiple of `{item.multiple_of!r}`")
        if isinstance(item, at.MinLen):
            parts.append(f"length ≥ {item.min_length}")
        if isinstance(item, at.MaxLen):
            parts.append(f"length ≤ {item.max_length}")
        if getattr(item, "pattern", None):
            parts.append(f"matches `{item.pattern}`")
    choices = _choices(field.annotation)
    if choices:
        parts.append("one of " + ", ".join(f"`{c}`" for c in choices))
    return ", ".join(parts)


def env_names(cls: type, name: str, field) -> tuple[str, ...]:
    """The variables pydantic-settings reads the field from. Asked of its own env
    source, so prefixes, aliases and case rules are exactly what the service does."""
    from pydantic_settings import EnvSettingsSource

    names = [env for _, env, _ in EnvSettingsSource(cls)._extract_field_info(field, name)]
    if not cls.model_config.get("case_sensitive", False):
        names = [env.upper() for env in names]
    return tuple(dict.fromkeys(names))


# ---- what only the source knows: docstrings under fields, validator messages ----------


def _class_node(cls: type) -> ast.ClassDef | None:
    try:
        source = inspect.getsourcefile(cls)
    except TypeError:  # built in (object)
        return None
    if source is None or not Path(source).resolve().is_relative_to(REPO):
        return None
    tree = ast.parse(Path(source).read_text(encoding="utf-8"))
    nodes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__]
    return nodes[0] if nodes else None


def attribute_docstrings(cls: type) -> dict[str, str]:
    """Field name -> the string literal right under its annotated assignment, over the
    class and its bases (the class's own win)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        node = _class_node(klass) if isinstance(klass, type) else None
        if node is None:
            continue
        for statement, following in zip(node.body, node.body[1:]):
            if (
                isinstance(statement, ast.AnnAssign)
                and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[statement.target.id] = inspect.cleandoc(following.value.value)
    return docs


def _message(node: ast.expr) -> str | None:
    """The text of a string or f-string literal, ``{expr}`` standing for each value."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            elif isinstance(value, ast.FormattedValue):
                expression = ast.unparse(value.value).removeprefix("self.")
                parts.append("{" + (expression if expression.isidentifier() else "…") + "}")
        return "".join(parts)
    return None


def validator_messages(cls: type) -> tuple[str, ...]:
    """The ValueError messages raised in the class's validators (and ``__init__``)."""
    messages = []
    for klass in reversed(cls.__mro__):
        node = _class_node(klass) if isinstance(klass, type) else None
        if node is None:
            continue
        for method in node.body:
            if not isinstance(method, ast.FunctionDef):
                continue
            decorators = [ast.unparse(d) for d in method.decorator_list]
            if method.name != "__init__" and not any("validator" in d for d in decorators):
                continue
            for raised in ast.walk(method):
                if (
                    isinstance(raised, ast.Raise)
                    and isinstance(raised.exc, ast.Call)
                    and ast.unparse(raised.exc.func) == "ValueError"
                    and raised.exc.args
                ):
                    text = _message(raised.exc.args[0])
                    if text is not None:
                        messages.append(text)
    return tuple(dict.fromkeys(messages))


def settings_docs() -> list[SettingsDoc]:
    docs = []
    for cls in settings_classes():
        qualname = f"{cls.__module__}.{cls.__qualname__}"
        title, read_by = SECTIONS.get(qualname, (cls.__name__, f"`{cls.__module__}`"))
        docstrings = attribute_docstrings(cls)
        fields = tuple(
            FieldDoc(
                name=name,
                env_names=env_names(cls, name, field),
                type=type_text(field.annotation),
                default=default_text(name, field),
                constraints=constraints_text(name, field),
                description=field.description or docstrings.get(name, ""),
            )
            for name, field in cls.model_fields.items()
        )
        summary = inspect.cleandoc(cls.__doc__).split("\n\n")[0] if cls.__dict__.get("__doc__") else ""
        docs.append(
            SettingsDoc(
                qualname=qualname,
                path=Path(inspect.getsourcefile(cls)).resolve().relative_to(REPO).as_posix(),
                title=title,
                read_by=read_by,
                env_prefix=cls.model_config.get("env_prefix", ""),
                summary=" ".join(summary.split()),
                fields=fields,
                checks=validator_messages(cls),
            )
        )
    return docs


# ---- Markdown ------------------------------------------------------------------------------


def cell(text: str) -> str:
    """Docstring text as one Markdown table cell: reST ``code`` to Markdown, paragraphs
    kept apart, and what a table or HTML would swallow escaped."""
    text = re.sub(r"``(.+?)``", r"`\1`", text, flags=re.DOTALL)
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]
    return "<br>".join(_escape(p) for p in paragraphs)


def _escape(text: str) -> str:
    parts = text.split("`")
    if len(parts) % 2 == 0:  # an unpaired backtick is text
        parts[-2:] = [parts[-2] + "\\`" + parts[-1]]
    for i, part in enumerate(parts):
        part = part.replace("|", "\\|")
        if i % 2 == 0:  # outside code spans
            part = part.replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*")
        parts[i] = part
    return "`".join(parts)


def anchor(title: str) -> str:
    """GitHub's heading anchor."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


GENERATED = "<!-- Generated by `python -m rtrl.docgen` from the code; do not edit. `python -m rtrl.docgen --check` fails when it is stale. -->"


def render_configuration(docs: list[SettingsDoc]) -> str:
    lines = [
        GENERATED,
        "",
        "# Configuration reference",
        "",
        "Every rtrl service is configured by environment variables only, read by one",
        "pydantic-settings class per service. This page is generated from those classes:",
        "names, types, defaults and constraints from pydantic, descriptions from the",
        "docstring under each field. The operator's guide is [operations.md](operations.md).",
        "",
        "- A variable's name is the class's prefix plus the field name, upper-cased.",
        "- Lists are written as JSON: `'[\"control\",\"treatment\"]'`. Booleans as `true` / `false`.",
        "- Secrets show as (secret). The two weight-sync tokens default to development values;",
        "  compose/compose.yaml refuses to start until both are set.",
        "- A value outside its constraints, or one that fails a check listed under a class,",
        "  stops the process at start-up with a validation error naming the field.",
        "",
        "| section | prefix | class | read by |",
        "|---|---|---|---|",
    ]
    for doc in docs:
        lines.append(f"| [{doc.title}](#{anchor(doc.title)}) | `{doc.env_prefix}` | `{doc.qualname}` | {doc.read_by} |")
    for doc in docs:
        lines += ["", f"## {doc.title}", ""]
        lines.append(f"`{doc.qualname.rsplit('.', 1)[1]}` in [`{doc.path}`](../{doc.path}), prefix `{doc.env_prefix}`; read by {doc.read_by}.")
        if doc.summary:
            lines += ["", cell(doc.summary)]
        lines += ["", "| variable | type | default | constraints | description |", "|---|---|---|---|---|"]
        for field in doc.fields:
            names = "<br>".join(f"`{n}`" for n in field.env_names)
            description = cell(field.description) if field.description else "**undocumented**"
            lines.append(f"| {names} | {field.type} | {field.default} | {field.constraints} | {description} |")
        if doc.checks:
            lines += ["", "Checked at start-up (`{name}` stands for a value):", ""]
            lines += [f"- {_code(check)}" for check in doc.checks]
    return "\n".join(lines) + "\n"


def _code(text: str) -> str:
    """A code span, also when the text holds a backtick."""
    return f"`` {text} ``" if "`" in text else f"`{text}`"


# ---- topics ------------------------------------------------------------------------------

_NEW_TOPIC_PARAMETERS = ("topic", "num_partitions", "replication_factor", "replica_assignment", "config")


@dataclass(frozen=True)
class CallSite:
    path: str
    line: int
    function: str
    arguments: dict[str, str]
    """Parameter -> its expression in the source."""


def call_sites(function: str, parameters: tuple[str, ...] = ()) -> list[CallSite]:
    """Every call of ``function`` (by name or as an attribute) in the service code."""
    sites = []
    for path in service_sources():
        source = path.read_text(encoding="utf-8")
        if function not in source:
            continue
        tree = ast.parse(source)
        for outer in ast.walk(tree):
            if not isinstance(outer, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(outer):
                if not isinstance(node, ast.Call):
                    continue
                # Called, or handed to a runner: asyncio.to_thread(kafka.ensure_topics, stack).
                if _named(node.func, function):
                    passed = node.args
                elif node.args and _named(node.args[0], function):
                    passed = node.args[1:]
                else:
                    continue
                arguments = {parameters[i]: ast.unparse(a) for i, a in enumerate(passed) if i < len(parameters)}
                arguments.update({k.arg: ast.unparse(k.value) for k in node.keywords if k.arg})
                sites.append(CallSite(path.relative_to(REPO).as_posix(), node.lineno, outer.name, arguments))
    # A call inside a nested function is found from both functions: keep the innermost.
    unique: dict[tuple[str, int], CallSite] = {}
    for site in sites:
        unique[(site.path, site.line)] = site
    return sorted(unique.values(), key=lambda s: (s.path, s.line))


def _named(node: ast.expr, name: str) -> bool:
    return (isinstance(node, ast.Name) and node.id == name) or (isinstance(node, ast.Attribute) and node.attr == name)


def _setting_expression(expression: str) -> str:
    """``settings.kafka_partitions`` -> the variable and default of that shared setting."""
    from rtrl.config import StackSettings

    attribute = expression.rsplit(".", 1)[-1]
    field = StackSettings.model_fields.get(attribute)
    if "." in expression and field is not None:
        return f"`{env_names(StackSettings, attribute, field)[0]}` (default {default_text(attribute, field)})"
    return f"`{expression}`"


def topic_groups() -> dict[str, set[str]]:
    """Topic name -> names in rtrl.topics that stand for it (constants, tuples, maps)."""
    from rtrl import topics

    groups: dict[str, set[str]] = {}
    for name, value in vars(topics).items():
        if not name.isupper():
            continue
        members = [value] if isinstance(value, str) else list(value.values()) if isinstance(value, dict) else list(value)
        for member in members:
            if isinstance(member, str):
                groups.setdefault(member, set()).add(name)
    return groups


def topic_references() -> dict[str, list[str]]:
    """Name in rtrl.topics -> the service files that use it as ``topics.NAME``."""
    used: dict[str, set[str]] = {}
    for path in service_sources():
        if path.relative_to(REPO).as_posix() == "rtrl/topics.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "topics" and node.attr.isupper():
                used.setdefault(node.attr, set()).add(path.relative_to(REPO).as_posix())
    return {name: sorted(paths) for name, paths in used.items()}


def render_topics(docs: list[SettingsDoc]) -> str:
    from rtrl import topics
    from rtrl.status_view import CONSUMER_GROUPS

    creations = call_sites("NewTopic", _NEW_TOPIC_PARAMETERS)
    ensures = call_sites("ensure_topics", ("settings", "names"))
    groups = topic_groups()
    references = topic_references()
    # Services that name a topic through a setting (the trainer's RTRL_TRAINER_TOPIC).
    by_setting: dict[str, list[str]] = {}
    for doc in docs:
        for field in doc.fields:
            if field.default.strip("`") in topics.ALL:
                by_setting.setdefault(field.default.strip("`"), []).append(f"`{doc.qualname.split('.')[0]}` (default of `{field.env_names[0]}`)")
    lines = [
        GENERATED,
        "",
        "# Topics and tables",
        "",
        "Generated from [`rtrl/topics.py`](../rtrl/topics.py) and the code that creates the",
        "topics. Who produces and who consumes each one, and what retention means on each",
        "broker, is in [operations.md](operations.md#topics-and-retention).",
        "",
        "## How they are created",
        "",
    ]
    for site in creations:
        partitions = _setting_expression(site.arguments.get("num_partitions", "-1"))
        replication = _setting_expression(site.arguments["replication_factor"]) if "replication_factor" in site.arguments else "the broker's default"
        config = site.arguments.get("config")
        lines += [
            f"`NewTopic` in `{site.function}()` ([`{site.path}`](../{site.path})):",
            "",
            f"- partitions: {partitions}, the same for every topic;",
            f"- replication factor: {replication};",
            f"- topic configuration: {f'`{config}`' if config else 'none set: retention, cleanup policy and segment sizes are the broker defaults'}.",
            "",
        ]
    lines += [
        "Callers of `ensure_topics`, which creates the topics that are missing and raises when an",
        "existing one's partition count differs from the configured one:",
        "",
    ]
    for site in ensures:
        names = site.arguments.get("names")
        what = f"only `{names}`" if names else "every topic in `topics.ALL`"
        lines.append(f"- `{site.function}()` in [`{site.path}`](../{site.path}): {what}")
    lines += [
        "",
        "## The topics",
        "",
        "| topic | in `rtrl.topics` | read by the joiner (`TELEMETRY`) | consumer groups `rtrl status` shows lag for | packages naming it |",
        "|---|---|---|---|---|",
    ]
    for topic in topics.ALL:
        names = sorted(groups.get(topic, ()))
        readers = [group for group, names_read in CONSUMER_GROUPS.items() if topic in names_read]
        packages = sorted({path.split("/")[0] for n in names for path in references.get(n, ())})
        lines.append(
            f"| `{topic}` | {', '.join(f'`{n}`' for n in names)} | {'yes' if topic in topics.TELEMETRY else 'no'} "
            f"| {', '.join(f'`{g}`' for g in readers) or '—'} | {', '.join([*(f'`{p}`' for p in packages), *by_setting.get(topic, [])])} |"
        )
    replay = topics.reward_replay("<version>")
    lines += [
        "",
        f"Also `{replay}` (`topics.reward_replay`): {cell(inspect.getdoc(topics.reward_replay) or '')}",
        "",
        *render_tables(),
    ]
    return "\n".join(lines) + "\n"


_TABLE = re.compile(r"CREATE TABLE IF NOT EXISTS (\w+) \((.*)\)\s*ENGINE = (.+?)\s*$", re.DOTALL)
_VIEW = re.compile(r"CREATE MATERIALIZED VIEW IF NOT EXISTS (\w+) TO (\w+) AS .*?\bFROM (\w+)", re.DOTALL)


class _RecordingClient:
    """Stands in for ClickHouse while analytics.schema.create_tables runs: keeps each
    statement and answers that every table exists and holds rows (so nothing is backfilled)."""

    def __init__(self) -> None:
        self.statements: list[str] = []

    def command(self, statement: str) -> str:
        self.statements.append(" ".join(statement.split()) if "VIEW" in statement else statement.strip())
        return "1"


def render_tables() -> list[str]:
    """The analytics sink's ClickHouse tables, from the statements it runs at start-up."""
    from analytics import schema

    client = _RecordingClient()
    schema.create_tables(client)
    views = {found.group(2): found.groups() for found in map(_VIEW.search, client.statements) if found}
    lines = [
        "## ClickHouse tables",
        "",
        "Created by the analytics sink at start-up ([`analytics/schema.py`](../analytics/schema.py)),",
        "the same statements on chdb and on a ClickHouse server.",
        "",
        "| table | engine and key | filled by | columns |",
        "|---|---|---|---|",
    ]
    for statement in client.statements:
        found = _TABLE.search(statement)
        if found is None:
            continue
        name, body, engine = found.groups()
        columns = [line.strip().split()[0] for line in body.splitlines() if line.strip()]
        filled_by = f"materialized view `{views[name][0]}` over `{views[name][2]}`" if name in views else "the sink"
        lines.append(f"| `{name}` | `{' '.join(engine.split())}` | {filled_by} | {', '.join(f'`{c}`' for c in columns)} |")
    return lines


# ---- entry point -----------------------------------------------------------------------------


def render() -> dict[Path, str]:
    """Repository-relative path -> the file's generated text."""
    docs = settings_docs()
    return {CONFIGURATION: render_configuration(docs), TOPICS: render_topics(docs)}


def stale(generated: dict[Path, str]) -> list[Path]:
    return [path for path, text in generated.items() if not (REPO / path).exists() or (REPO / path).read_text(encoding="utf-8") != text]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m rtrl.docgen", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a generated file differs from the code")
    args = parser.parse_args()
    generated = render()
    if args.check:
        outdated = stale(generated)
        for path in outdated:
            current = (REPO / path).read_text(encoding="utf-8").splitlines() if (REPO / path).exists() else []
            diff = list(difflib.unified_diff(current, generated[path].splitlines(), str(path), f"{path} (from the code)", lineterm=""))
            print(f"{path} is stale: run `python -m rtrl.docgen` and commit it", file=sys.stderr)
            print("\n".join(diff[:60]) + ("\n…" if len(diff) > 60 else ""), file=sys.stderr)
        raise SystemExit(1 if outdated else 0)
    for path, text in generated.items():
        (REPO / path).parent.mkdir(parents=True, exist_ok=True)
        (REPO / path).write_text(text, encoding="utf-8")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
