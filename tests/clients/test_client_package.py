"""The Python client as a product installs it: ``pip install clients/python`` into a fresh
virtualenv pulls none of the server's heavy dependencies, and the README's example sends
events that land exactly once through a running gateway."""

import json
import shutil
import subprocess
import venv
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from rtrl_client import Telemetry
from rtrl_client.prometheus import TelemetryCollector
from support.gateway import event_ids_on_topics

REPO = Path(__file__).resolve().parents[2]
SERVER_ONLY = {"torch", "faust-streaming", "chdb", "numba", "confluent-kafka", "transformers"}
"""What a product must not have to install to send a few events."""


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory) -> Path:
    """A fresh virtualenv with ``pip install <a copy of clients/python>`` and nothing else."""
    root = tmp_path_factory.mktemp("client")
    # A copy: building in place would leave build/ and egg-info in the checkout.
    source = shutil.copytree(
        REPO / "clients" / "python",
        root / "src",
        ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "build"),
    )
    venv.create(root / "venv", with_pip=True)
    python = root / "venv" / "bin" / "python"
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", str(source)],
        check=True,
        timeout=600,
    )
    return python


@pytest.mark.slow
def test_installing_the_client_pulls_no_server_dependency(client_venv):
    listed = subprocess.run(
        [client_venv, "-m", "pip", "list", "--format", "json"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    installed = {package["name"].lower() for package in json.loads(listed)}
    print("pip list:", sorted(installed))
    assert "rtrl-client" in installed and {"protobuf", "aiohttp"} <= installed
    assert installed & SERVER_ONLY == set()
    assert not any(name == "rtrl" or name.startswith("faust") for name in installed)
    # And the package imports without the server beside it.
    subprocess.run(
        [client_venv, "-I", "-c", "import rtrl_client, rtrl_client.v1.ingest_pb2"],
        check=True,
    )


@pytest.mark.slow
@pytest.mark.integration
def test_the_readme_example_lands_each_event_once(
    client_venv, repo_root, gateway, api_key, stack_settings, tmp_path
):
    example = repo_root / "clients" / "python" / "examples" / "send_events.py"
    env = {"RTRL_INGEST_URL": gateway.url, "RTRL_API_KEY": api_key, "PATH": "/usr/bin:/bin"}
    sent: list[str] = []
    for run in range(2):  # the second run reuses the spool: it must not resend the first's
        out = subprocess.run(
            [client_venv, "-I", example, "--spool", tmp_path / "spool", "--rollout-id", f"r{run}"],
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
    landed = event_ids_on_topics(stack_settings)
    assert {event_id: landed[event_id] for event_id in sent} == dict.fromkeys(sent, 1)


def test_the_collector_exports_the_spool_under_the_alerted_names(tmp_path, repo_root):
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
        rules = (repo_root / "deploy" / "prometheus" / "alerts.yml").read_text()
        assert "rtrl_sdk_spool_bytes" in rules or "rtrl_sdk_spool_events" in rules
    finally:
        telemetry.close(timeout_s=0)
