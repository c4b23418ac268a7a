"""The monitoring of deploy/: the alert rules are valid and pass their promtool unit tests,
every alert is tested firing and quiet, the dashboards pass Grafana's own schema and
every query in them is PromQL Prometheus accepts. That each metric they read is exported
is checked against a live stack in tests/e2e/test_e2e.py."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import yaml

from support.monitoring import (
    ALERTS,
    ALERTS_TEST,
    DASHBOARDS,
    GRAFANA,
    as_promql,
    dashboard_queries,
    dashboards,
    metric_names,
    panels,
    promtool,
    rules,
)


def run_promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120)


def test_the_alert_rules_are_valid_and_pass_their_unit_tests():
    checked = run_promtool("check", "rules", str(ALERTS))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = run_promtool("test", "rules", str(ALERTS_TEST))
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_is_tested_firing_and_quiet():
    cases: dict[str, set[bool]] = {rule["alert"]: set() for rule in rules()}
    for test in yaml.safe_load(ALERTS_TEST.read_text())["tests"]:
        for case in test["alert_rule_test"]:
            cases[case["alertname"]].add(bool(case.get("exp_alerts")))
    assert {alert: seen for alert, seen in cases.items() if seen != {True, False}} == {}


def test_a_rule_that_drifts_from_its_unit_test_fails_it(tmp_path):
    """The unit tests do hold the rules: a threshold moved by a factor of ten fails them."""
    text, late = ALERTS.read_text(), "rtrl_reward_stream_records_total[15m])) > 0.05\n"
    assert text.count(late) == 1
    (tmp_path / ALERTS.name).write_text(text.replace(late, late.replace("0.05", "0.5")))
    shutil.copy(ALERTS_TEST, tmp_path / ALERTS_TEST.name)
    tested = run_promtool("test", "rules", str(tmp_path / ALERTS_TEST.name))
    assert (
        tested.returncode != 0 and "alertname: RtrlLateEventsHigh" in tested.stdout + tested.stderr
    )


def test_every_alert_says_how_bad_and_what_happened():
    for rule in rules():
        assert rule["labels"]["severity"] in ("page", "warning"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def check_dashboards(directory) -> subprocess.CompletedProcess:
    if not (GRAFANA / "node_modules" / "@grafana" / "schema").exists():
        pytest.fail("deploy/grafana's npm packages are not installed: run `make install`")
    return subprocess.run(
        ["node", str(GRAFANA / "check-dashboards.mjs"), str(directory)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_dashboards_pass_grafanas_own_schema():
    checked = check_dashboards(DASHBOARDS)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"{len(dashboards())} dashboards checked" in checked.stdout
    assert "loop.json" in dashboards(), "the main dashboard is deploy/grafana/dashboards/loop.json"


PLANTED = {
    "misspelt.json": (lambda d: d.update(panles=d.pop("panels")), "'\"panles\"' does not exist"),
    "unversioned.json": (lambda d: d.pop("schemaVersion"), "'schemaVersion' is missing"),
    "enum.json": (
        lambda d: panels(d)[1]["options"].update(colorMode="valu"),
        "'\"valu\"' is not assignable",
    ),
    "type.json": (
        lambda d: panels(d)[1]["gridPos"].update(w="6"),
        "'string' is not assignable to type 'number'",
    ),
    "plugin.json": (
        lambda d: panels(d)[1].update(type="weird"),
        'panel type "weird" has no schema',
    ),
    "legend.json": (
        lambda d: next(p for p in panels(d) if p["type"] == "timeseries")["options"].pop("legend"),
        "'legend' is missing",
    ),
}


def test_the_schema_check_refuses_each_planted_mistake(tmp_path):
    for name, (mistake, _) in PLANTED.items():
        dashboard = dashboards()["loop.json"]
        assert panels(dashboard)[1]["type"] == "stat"
        mistake(dashboard)
        (tmp_path / name).write_text(json.dumps(dashboard))
    checked = check_dashboards(tmp_path)
    assert checked.returncode == 1, checked.stdout + checked.stderr
    errors = checked.stderr.splitlines()
    for name, (_, error) in PLANTED.items():
        assert any(line.startswith(str(tmp_path / name)) and error in line for line in errors), (
            f"{name}: no {error!r} in\n{checked.stderr}"
        )


def test_every_dashboard_query_is_promql_prometheus_accepts(tmp_path):
    """Each query, with Grafana's interval variables filled in, as a recording rule promtool parses."""
    queries = dashboard_queries()
    assert queries
    recorded = [
        {"record": f"rtrl:query:{i}", "expr": as_promql(q)} for i, (*_, q) in enumerate(queries)
    ]
    (tmp_path / "queries.yml").write_text(
        yaml.safe_dump({"groups": [{"name": "dashboards", "rules": recorded}]})
    )
    checked = run_promtool("check", "rules", str(tmp_path / "queries.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_every_panel_reads_the_provisioned_prometheus():
    provisioned = yaml.safe_load(
        (GRAFANA / "provisioning" / "datasources" / "rtrl.yml").read_text()
    )
    (datasource,) = provisioned["datasources"]
    for name, dashboard in dashboards().items():
        for panel in panels(dashboard):
            for where in (panel, *panel.get("targets", [])):
                if "datasource" in where:
                    assert where["datasource"] == {
                        "type": "prometheus",
                        "uid": datasource["uid"],
                    }, f"{name}: {panel['title']}"
    assert len({d["uid"] for d in dashboards().values()}) == len(dashboards()), "uids repeat"


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('sum by (arm) (rate(a_total{x="}y"}[5m] offset 1h))', {"a_total"}),
        ("b / on (arm) group_left (le) c * 1e3 + 0x1f > bool d", {"b", "c", "d"}),
        ('label_replace(sum(e), "f", "g", "", "") or topk(3, h) unless absent(i)', {"e", "h", "i"}),
        ("deriv(sum by (group) (j)[15m:1m]) > 0 and on () k", {"j", "k"}),
    ],
)
def test_metric_names_are_read_out_of_promql(expr, names):
    assert metric_names(expr) == names
