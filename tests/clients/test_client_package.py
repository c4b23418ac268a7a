"""The Python client as a product uses it: the README's example sends events that land
exactly once through a running gateway, and the Prometheus collector exports the spool under
the names the alert rules watch.

Runs under every Python the client supports, each in a virtualenv holding rtrl-client alone
(test_client_pythons.py, which also checks what installing it pulls in)."""

import json
import shutil
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from rtrl_client import Telemetry
from rtrl_client.prometheus import TelemetryCollector
from support.ingest_rig import REPO


@pytest.mark.integration
def test_the_readme_example_lands_each_event_once(gateway, api_key, tmp_path):
    example = REPO / "clients" / "python" / "examples" / "send_events.py"
    env = {"RTRL_INGEST_URL": gateway.url, "RTRL_API_KEY": api_key, "PATH": "/usr/bin:/bin"}
    sent: list[str] = []
    for run in range(2):  # the second run reuses the spool: it must not resend the first's
        # -I: the example sees the installed package and nothing of this checkout.
        out = subprocess.run(
            [
                sys.executable,
                "-I",
                example,
                "--spool",
                tmp_path / "spool",
                "--rollout-id",
                f"r{run}",
            ],
            env=env,
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout.splitlines()
        lines = [json.loads(line) for line in out]
        sent += [line["event_id"] for line in lines[:-1]]
        assert lines[-1] == {"delivered": True, "accepted": 4, "duplicate": 0, "rejected": 0}
    assert len(sent) == len(set(sent)) == 8
    landed = gateway.count()
    assert {event_id: landed[event_id] for event_id in sent} == dict.fromkeys(sent, 1)


def test_the_collector_exports_the_spool_under_the_alerted_names(tmp_path):
    """The names deploy/prometheus/alerts.yml watches, read from a live Telemetry, and a
    page promtool accepts."""
    telemetry = Telemetry("http://127.0.0.1:9", spool_dir=tmp_path / "spool")  # nobody listens
    try:
        telemetry.edit_outcome(rollout_id="r", session_id="s", user_id="u", outcome="accepted")
        registry = CollectorRegistry()
        registry.register(TelemetryCollector(telemetry, client="editor"))
        page = generate_latest(registry).decode()
        values = {
            line.split(" ")[0]: float(line.split(" ")[1])
            for line in page.splitlines()
            if line and not line.startswith("#")
        }
        assert values['rtrl_sdk_spool_events{client="editor"}'] == 1
        assert values['rtrl_sdk_spool_bytes{client="editor"}'] > 0
        assert values['rtrl_sdk_rejected_events_total{client="editor"}'] == 0
        assert values['rtrl_sdk_spool_oldest_age_seconds{client="editor"}'] >= 0
        promtool = shutil.which("promtool")
        assert promtool, "promtool is missing: scripts/bootstrap.sh installs Debian's prometheus"
        checked = subprocess.run(
            [promtool, "check", "metrics"], input=page, capture_output=True, text=True
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr
        rules = (REPO / "deploy" / "prometheus" / "alerts.yml").read_text()
        assert "rtrl_sdk_spool_bytes" in rules or "rtrl_sdk_spool_events" in rules
    finally:
        telemetry.close(timeout_s=0)
