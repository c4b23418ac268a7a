"""``docs/configuration.md``: every pydantic-settings class of the service packages,
its fields and their constraints from pydantic, the docstring under each field and the
messages of its validators from the source."""

from __future__ import annotations

import ast
import enum
import importlib
import inspect
import json
import types
import typing
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path, PurePath

from ._common import GENERATED, REPO, anchor, cell, module_name, service_sources

if typing.TYPE_CHECKING:
    from pydantic_settings import BaseSettings

# Section order and who reads each class. A class not named here still gets a
# section (titled by its name) after these, so a new one is never left out.
SECTIONS = {
    "rtrl.config.StackSettings": (
        "Shared connections",
        "every service, the `rtrl` CLI and the supervisor",
    ),
    "rtrl.ops.stack.StackConfig": (
        "Embedded stack",
        "`rtrl up`, `rtrl demo` and the supervisor they start (not the services)",
    ),
    "ingest.config.IngestSettings": ("Ingest gateway", "`python -m rtrl.ingest`"),
    "reward_stream.config.RewardStreamSettings": (
        "Reward stream",
        "`python -m rtrl.reward_stream`, and `python -m rtrl.reward_stream.replay` for its join window",
    ),
    "trainer.config.TrainerSettings": (
        "Trainer",
        "`python -m rtrl.trainer`, and every rank of `torchrun … -m rtrl.trainer`",
    ),
    "weight_sync.config.WeightSyncSettings": ("Weight sync server", "`python -m rtrl.weight_sync`"),
    "weight_sync.relay.RelaySettings": ("Weight sync relay", "`python -m rtrl.weight_sync.relay`"),
    "inference.config.InferenceSettings": ("Inference worker", "`python -m rtrl.inference`"),
    "inference.sglang_sidecar.SidecarSettings": (
        "SGLang sidecar",
        "`python -m rtrl.inference.sglang_sidecar`",
    ),
    "analytics.config.AnalyticsSettings": ("Analytics sink", "`python -m rtrl.analytics`"),
}


# Produced by settings_docs; consumed by render_configuration and topics.render_topics.
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


def settings_classes() -> list[type[BaseSettings]]:
    """Every settings class defined in the service packages (a BaseSettings subclass with
    an env prefix: not rtrl.config.Settings, their common base), in section order."""
    from pydantic_settings import BaseSettings

    modules = {
        module_name(path)
        for path in service_sources()
        if "SettingsConfigDict" in path.read_text(encoding="utf-8")
    }
    for name in sorted(modules):
        importlib.import_module(name)
    found: dict[str, type[BaseSettings]] = {}
    pending = list(BaseSettings.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls.__module__ in modules and cls.model_config.get("env_prefix"):
            found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    order = list(SECTIONS)
    return [
        found[q]
        for q in sorted(found, key=lambda q: (order.index(q) if q in order else len(order), q))
    ]


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
        return (
            f"`{json.dumps(sorted(value) if isinstance(value, (set, frozenset)) else list(value))}`"
        )
    if isinstance(value, (int, float)):
        return _number(value, name)
    return f"`{value}`"


def constraints_text(name: str, field) -> str:
    import annotated_types as at

    parts = []
    for item in field.metadata:
        for kind, attribute, symbol in (
            (at.Gt, "gt", ">"),
            (at.Ge, "ge", "≥"),
            (at.Lt, "lt", "<"),
            (at.Le, "le", "≤"),
        ):
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


def env_names(cls: type[BaseSettings], name: str, field) -> tuple[str, ...]:
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
        for statement, following in pairwise(node.body):
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
        own_doc: str | None = cls.__dict__.get("__doc__")
        summary = inspect.cleandoc(own_doc).split("\n\n")[0] if own_doc else ""
        source = inspect.getsourcefile(cls)
        assert source is not None, cls  # imported from one of service_sources()
        docs.append(
            SettingsDoc(
                qualname=qualname,
                path=Path(source).resolve().relative_to(REPO).as_posix(),
                title=title,
                read_by=read_by,
                env_prefix=cls.model_config.get("env_prefix", ""),
                summary=" ".join(summary.split()),
                fields=fields,
                checks=validator_messages(cls),
            )
        )
    return docs


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
        '- Lists are written as JSON: `\'["control","treatment"]\'`. Booleans as `true` / `false`.',
        "- Secrets show as (secret). The two weight-sync tokens default to development values;",
        "  compose/compose.yaml refuses to start until both are set.",
        "- A value outside its constraints, or one that fails a check listed under a class,",
        "  stops the process at start-up with a validation error naming the field.",
        "",
        "| section | prefix | class | read by |",
        "|---|---|---|---|",
    ]
    for doc in docs:
        lines.append(
            f"| [{doc.title}](#{anchor(doc.title)}) | `{doc.env_prefix}` | `{doc.qualname}` | {doc.read_by} |"
        )
    for doc in docs:
        lines += ["", f"## {doc.title}", ""]
        lines.append(
            f"`{doc.qualname.rsplit('.', 1)[1]}` in [`{doc.path}`](../{doc.path}), "
            f"prefix `{doc.env_prefix}`; read by {doc.read_by}."
        )
        if doc.summary:
            lines += ["", cell(doc.summary)]
        lines += [
            "",
            "| variable | type | default | constraints | description |",
            "|---|---|---|---|---|",
        ]
        for field in doc.fields:
            names = "<br>".join(f"`{n}`" for n in field.env_names)
            description = cell(field.description) if field.description else "**undocumented**"
            lines.append(
                f"| {names} | {field.type} | {field.default} | {field.constraints} | {description} |"
            )
        if doc.checks:
            lines += ["", "Checked at start-up (`{name}` stands for a value):", ""]
            lines += [f"- {_code(check)}" for check in doc.checks]
    return "\n".join(lines) + "\n"


def _code(text: str) -> str:
    """A code span, also when the text holds a backtick."""
    return f"`` {text} ``" if "`" in text else f"`{text}`"
