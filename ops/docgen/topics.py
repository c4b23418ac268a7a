"""``docs/topics.md``: how the Kafka topics are created and who names each one, from
rtrl/topics.py and the code that creates them, and the analytics sink's ClickHouse
tables, from the statements it runs at start-up."""

from __future__ import annotations

import ast
import inspect
import re
from dataclasses import dataclass

from ._common import GENERATED, REPO, cell, service_sources
from .configuration import SettingsDoc, default_text, env_names

_NEW_TOPIC_PARAMETERS = (
    "topic",
    "num_partitions",
    "replication_factor",
    "replica_assignment",
    "config",
)


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
                arguments = {
                    parameters[i]: ast.unparse(a)
                    for i, a in enumerate(passed)
                    if i < len(parameters)
                }
                arguments.update({k.arg: ast.unparse(k.value) for k in node.keywords if k.arg})
                sites.append(
                    CallSite(path.relative_to(REPO).as_posix(), node.lineno, outer.name, arguments)
                )
    # A call inside a nested function is found from both functions: keep the innermost.
    unique: dict[tuple[str, int], CallSite] = {}
    for site in sites:
        unique[(site.path, site.line)] = site
    return sorted(unique.values(), key=lambda s: (s.path, s.line))


def _named(node: ast.expr, name: str) -> bool:
    return (isinstance(node, ast.Name) and node.id == name) or (
        isinstance(node, ast.Attribute) and node.attr == name
    )


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
        members = (
            [value]
            if isinstance(value, str)
            else list(value.values())
            if isinstance(value, dict)
            else list(value)
        )
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
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "topics"
                and node.attr.isupper()
            ):
                used.setdefault(node.attr, set()).add(path.relative_to(REPO).as_posix())
    return {name: sorted(paths) for name, paths in used.items()}


def render_topics(docs: list[SettingsDoc]) -> str:
    from rtrl import topics

    replay = topics.reward_replay("<version>")
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
        *render_creations(),
        "",
        "## The topics",
        "",
        *render_topic_table(docs),
        "",
        f"Also `{replay}` (`topics.reward_replay`): {cell(inspect.getdoc(topics.reward_replay) or '')}",
        "",
        *render_tables(),
    ]
    return "\n".join(lines) + "\n"


def render_creations() -> list[str]:
    """Where ``NewTopic`` is called, with what, and who calls ``ensure_topics``."""
    lines = []
    for site in call_sites("NewTopic", _NEW_TOPIC_PARAMETERS):
        partitions = _setting_expression(site.arguments.get("num_partitions", "-1"))
        replication = (
            _setting_expression(site.arguments["replication_factor"])
            if "replication_factor" in site.arguments
            else "the broker's default"
        )
        config = site.arguments.get("config")
        topic_config = (
            f"`{config}`"
            if config
            else "none set: retention, cleanup policy and segment sizes are the broker defaults"
        )
        lines += [
            f"`NewTopic` in `{site.function}()` ([`{site.path}`](../{site.path})):",
            "",
            f"- partitions: {partitions}, the same for every topic;",
            f"- replication factor: {replication};",
            f"- topic configuration: {topic_config}.",
            "",
        ]
    lines += [
        "Callers of `ensure_topics`, which creates the topics that are missing and raises when an",
        "existing one's partition count differs from the configured one:",
        "",
    ]
    for site in call_sites("ensure_topics", ("settings", "names")):
        names = site.arguments.get("names")
        what = f"only `{names}`" if names else "every topic in `topics.ALL`"
        lines.append(f"- `{site.function}()` in [`{site.path}`](../{site.path}): {what}")
    return lines


def render_topic_table(docs: list[SettingsDoc]) -> list[str]:
    """One row per topic: the names standing for it, who reads it, which packages name it."""
    from rtrl import topics
    from rtrl.ops.status_view import CONSUMER_GROUPS

    groups = topic_groups()
    references = topic_references()
    by_setting = _topics_by_setting(docs)
    lines = [
        (
            "| topic | in `rtrl.topics` | read by the joiner (`TELEMETRY`) "
            "| consumer groups `rtrl status` shows lag for | packages naming it |"
        ),
        "|---|---|---|---|---|",
    ]
    for topic in topics.ALL:
        constants = sorted(groups.get(topic, ()))
        readers = [group for group, names_read in CONSUMER_GROUPS.items() if topic in names_read]
        packages = sorted({path.split("/")[0] for n in constants for path in references.get(n, ())})
        constant_cell = ", ".join(f"`{n}`" for n in constants)
        joiner_cell = "yes" if topic in topics.TELEMETRY else "no"
        groups_cell = ", ".join(f"`{g}`" for g in readers) or "—"
        packages_cell = ", ".join([*(f"`{p}`" for p in packages), *by_setting.get(topic, [])])
        lines.append(
            f"| `{topic}` | {constant_cell} | {joiner_cell} | {groups_cell} | {packages_cell} |"
        )
    return lines


def _topics_by_setting(docs: list[SettingsDoc]) -> dict[str, list[str]]:
    """Topic -> the services that name it through a setting (the trainer's
    RTRL_TRAINER_TOPIC), as table text."""
    from rtrl import topics

    by_setting: dict[str, list[str]] = {}
    for doc in docs:
        for field in doc.fields:
            if field.default.strip("`") in topics.ALL:
                by_setting.setdefault(field.default.strip("`"), []).append(
                    f"`{doc.qualname.split('.')[0]}` (default of `{field.env_names[0]}`)"
                )
    return by_setting


_TABLE = re.compile(r"CREATE TABLE IF NOT EXISTS (\w+) \((.*)\)\s*ENGINE = (.+?)\s*$", re.DOTALL)
_VIEW = re.compile(
    r"CREATE MATERIALIZED VIEW IF NOT EXISTS (\w+) TO (\w+) AS .*?\bFROM (\w+)", re.DOTALL
)


class _RecordingClient:
    """Stands in for ClickHouse while analytics.schema.create_tables runs: keeps each
    statement and answers that every table exists and holds rows (so nothing is backfilled)."""

    def __init__(self) -> None:
        self.statements: list[str] = []

    def command(self, statement: str) -> str:
        self.statements.append(
            " ".join(statement.split()) if "VIEW" in statement else statement.strip()
        )
        return "1"


def render_tables() -> list[str]:
    """The analytics sink's ClickHouse tables, from the statements it runs at start-up."""
    from rtrl.analytics import schema

    client = _RecordingClient()
    schema.create_tables(client)
    views = {
        found.group(2): found.groups() for found in map(_VIEW.search, client.statements) if found
    }
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
        filled_by = (
            f"materialized view `{views[name][0]}` over `{views[name][2]}`"
            if name in views
            else "the sink"
        )
        lines.append(
            f"| `{name}` | `{' '.join(engine.split())}` | {filled_by} | {', '.join(f'`{c}`' for c in columns)} |"
        )
    return lines
