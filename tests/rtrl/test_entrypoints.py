"""Every service starts the same way: ``python -m SERVICE --help`` lists what configures
it, a bad setting is refused naming its variable (exit 2, no traceback), and nothing but
--help is taken from the command line."""

import subprocess
import sys

import pytest

from rtrl import entrypoint

SERVICES = {
    "ingest": ("IngestSettings", "RTRL_INGEST_HTTP_PORT"),
    "reward_stream": ("RewardStreamSettings", "RTRL_REWARD_WINDOW_S"),
    "trainer": ("TrainerSettings", "RTRL_TRAINER_BATCH_SIZE"),
    "inference": ("InferenceSettings", "RTRL_INFERENCE_HTTP_PORT"),
    "weight_sync": ("WeightSyncSettings", "RTRL_WEIGHT_SYNC_PORT"),
    "analytics": ("AnalyticsSettings", "RTRL_ANALYTICS_QUERY_PORT"),
    "weight_sync.relay": ("RelaySettings", "RTRL_WEIGHT_SYNC_RELAY_PORT"),
    "inference.sglang_sidecar": ("SidecarSettings", "RTRL_SGLANG_SIDECAR_HTTP_TIMEOUT_S"),
}


def run(
    module: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize("module", SERVICES)
def test_help_lists_every_setting_with_its_description(module):
    settings_class, a_variable = SERVICES[module]
    answer = run(module, "--help")
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout.startswith(f"usage: python -m {module} [--help]")
    assert f"{settings_class}:" in answer.stdout and "StackSettings:" in answer.stdout
    assert f"  {a_variable} (default " in answer.stdout
    # Every variable has its field's docstring under it.
    lines = answer.stdout.splitlines()
    variables = [i for i, line in enumerate(lines) if line.startswith("  RTRL_")]
    assert variables and all(lines[i + 1].startswith("      ") for i in variables), module


@pytest.mark.parametrize("module", SERVICES)
def test_a_bad_setting_is_refused_naming_its_variable(module):
    _, a_variable = SERVICES[module]
    answer = run(module, env={a_variable: "not-a-number"})
    assert answer.returncode == entrypoint.USAGE_ERROR
    assert answer.stderr.startswith(f"python -m {module}: invalid configuration:\n")
    assert f"\n  {a_variable}: " in answer.stderr
    assert "Traceback" not in answer.stderr


def test_arguments_are_refused_since_settings_come_from_the_environment():
    answer = run("trainer", "--batch-size", "8")
    assert answer.returncode == entrypoint.USAGE_ERROR and "see --help" in answer.stderr


def test_secrets_are_never_printed_by_help(monkeypatch):
    answer = run("trainer", "--help", env={"RTRL_TRAINER_MANIFEST_SIGNING_KEY": "do-not-print-me"})
    assert "do-not-print-me" not in answer.stdout
    assert "RTRL_TRAINER_MANIFEST_SIGNING_KEY (secret" in answer.stdout
