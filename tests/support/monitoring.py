"""The alert rules and dashboards of deploy/, read as the monitoring tests need them: the
PromQL expressions they hold, the metric names those expressions read, and promtool."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
ALERTS_TEST = REPO / "deploy" / "prometheus" / "alerts_test.yml"
GRAFANA = REPO / "deploy" / "grafana"
DASHBOARDS = GRAFANA / "dashboards"

# What PromQL names that are not metrics: aggregations, keywords, binary operators.
_AGGREGATIONS = {
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
    "bottomk", "topk", "quantile", "limitk", "limit_ratio",
}  # fmt: skip
_LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS = {"bool", "offset", "and", "or", "unless", "atan2", "inf", "nan"}
_IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_NUMBER = re.compile(r"0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_CLOSING = {"{": "}", "[": "]", "(": ")"}


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool is not installed: `make install` (scripts/bootstrap.sh) installs it")
    return found


def _skip_string(text: str, i: int) -> int:
    """The index after the string literal opening at ``text[i]``."""
    quote, i = text[i], i + 1
    while text[i] != quote:
        i += 2 if text[i] == "\\" and quote != "`" else 1
    return i + 1


def _skip_group(text: str, i: int) -> int:
    """The index after the bracket opening at ``text[i]`` closes (strings inside skipped)."""
    closing, i = _CLOSING[text[i]], i + 1
    while text[i] != closing:
        i = _skip_string(text, i) if text[i] in "\"'`" else i + 1
    return i + 1


def metric_names(expr: str) -> set[str]:
    """The metric names a (valid) PromQL expression selects: identifiers that are not a
    function or aggregation, a keyword, a label inside ``{...}`` or ``by (...)``, a
    string, a number or a duration."""
    names: set[str] = set()
    i = 0
    while i < len(expr):
        char = expr[i]
        if char in "\"'`":
            i = _skip_string(expr, i)
        elif char in "{[":
            i = _skip_group(expr, i)
        elif number := _NUMBER.match(expr, i) if char.isdigit() or char == "." else None:
            i = number.end()
        elif identifier := _IDENTIFIER.match(expr, i):
            word, i = identifier.group(), identifier.end()
            rest = expr[i:].lstrip()
            if word in _LABEL_LISTS and rest.startswith("("):
                i = _skip_group(expr, len(expr) - len(rest))
            elif word == "offset":
                i = len(expr) - len(rest) + len(rest.split(maxsplit=1)[0])
            elif not (word in _AGGREGATIONS | _KEYWORDS | _LABEL_LISTS or rest.startswith("(")):
                names.add(word)
        else:
            i += 1
    return names


def rules() -> list[dict]:
    return [
        rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]
    ]


def dashboards() -> dict[str, dict]:
    return {path.name: json.loads(path.read_text()) for path in sorted(DASHBOARDS.glob("*.json"))}


def panels(dashboard: dict) -> list[dict]:
    """Every panel, those inside rows included."""
    return [p for top in dashboard.get("panels", []) for p in (top, *top.get("panels", []))]


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title and query refId, PromQL) of every query of every panel."""
    return [
        (name, f"{panel['title']} {target['refId']}", target["expr"])
        for name, dashboard in dashboards().items()
        for panel in panels(dashboard)
        for target in panel.get("targets", [])
    ]


def as_promql(grafana_expr: str) -> str:
    """A dashboard query as Prometheus reads it once Grafana has put in its interval variables."""
    return re.sub(r"\$__(rate_)?interval", "1m", grafana_expr)


def expressions() -> dict[str, str]:
    """Where -> PromQL, for every alert rule and every dashboard query."""
    found = {f"alerts.yml: {rule['alert']}": rule["expr"] for rule in rules()}
    found |= {f"{name}: {title}": as_promql(expr) for name, title, expr in dashboard_queries()}
    return found
