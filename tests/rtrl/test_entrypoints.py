"""Every service starts the same way: ``python -m SERVICE --help`` lists what configures
it, a bad setting is refused naming its variable (exit 2, no traceback), a secret the
service needs is refused the same way when it is unset or malformed, and nothing but
--help is taken from the command line."""

import os
import subprocess
import sys

import pytest

from rtrl import entrypoint
from rtrl.config import RequiredSecret, StackSettings
from rtrl.inference.config import InferenceSettings

SERVICES = {
    "rtrl.ingest": ("IngestSettings", "RTRL_INGEST_HTTP_PORT"),
    "rtrl.reward_stream": ("RewardStreamSettings", "RTRL_REWARD_WINDOW_S"),
    "rtrl.trainer": ("TrainerSettings", "RTRL_TRAINER_BATCH_SIZE"),
    "rtrl.inference": ("InferenceSettings", "RTRL_INFERENCE_HTTP_PORT"),
    "rtrl.weight_sync": ("WeightSyncSettings", "RTRL_WEIGHT_SYNC_PORT"),
    "rtrl.analytics": ("AnalyticsSettings", "RTRL_ANALYTICS_QUERY_PORT"),
    "rtrl.weight_sync.relay": ("RelaySettings", "RTRL_WEIGHT_SYNC_RELAY_PORT"),
    "rtrl.inference.sglang_sidecar": ("SidecarSettings", "RTRL_SGLANG_SIDECAR_HTTP_TIMEOUT_S"),
}
# What a sidecar needs besides its secrets, so that only they are missing.
SIDECAR = {"RTRL_SGLANG_SIDECAR_MODEL_DIR": "/nonexistent/policy"}

# Each service (and the replay, which signs as the joiner) and every secret it does not start
# without, with its default settings (API keys required, weights followed).
REQUIRED = {
    "rtrl.ingest": (
        "RTRL_INGEST_EVENT_KEY",
        "RTRL_INGEST_ANALYTICS_EVENT_KEY",
        "RTRL_API_KEY_PUBLIC_KEYS",
    ),
    "rtrl.reward_stream": (
        "RTRL_REWARD_TRAINER_MAC_KEY",
        "RTRL_REWARD_ANALYTICS_MAC_KEY",
        "RTRL_REWARD_ROLLOUT_MAC_KEYS",
        "RTRL_REWARD_EVENT_KEYS",
    ),
    "rtrl.reward_stream.replay": (
        "RTRL_REWARD_TRAINER_MAC_KEY",
        "RTRL_REWARD_ANALYTICS_MAC_KEY",
        "RTRL_REWARD_ROLLOUT_MAC_KEYS",
        "RTRL_REWARD_EVENT_KEYS",
    ),
    "rtrl.trainer": (
        "RTRL_TRAINER_MANIFEST_SIGNING_KEY",
        "RTRL_TRAINER_REWARD_MAC_KEYS",
        "RTRL_WEIGHT_SYNC_TOKEN",
    ),
    "rtrl.inference": (
        "RTRL_INFERENCE_ROLLOUT_SIGNING_KEY",
        "RTRL_INFERENCE_ROLLOUT_MAC_KEY",
        "RTRL_API_KEY_PUBLIC_KEYS",
        "RTRL_WEIGHT_SYNC_SUBSCRIBE_TOKEN",
        "RTRL_MANIFEST_PUBLIC_KEYS",
    ),
    "rtrl.weight_sync": ("RTRL_WEIGHT_SYNC_TOKEN", "RTRL_WEIGHT_SYNC_SUBSCRIBE_TOKEN"),
    "rtrl.analytics": (
        "RTRL_ANALYTICS_ROLLOUT_PUBLIC_KEYS",
        "RTRL_ANALYTICS_REWARD_MAC_KEYS",
        "RTRL_ANALYTICS_EVENT_KEYS",
        "RTRL_MANIFEST_PUBLIC_KEYS",
    ),
    "rtrl.weight_sync.relay": ("RTRL_WEIGHT_SYNC_SUBSCRIBE_TOKEN",),
    "rtrl.inference.sglang_sidecar": (
        "RTRL_WEIGHT_SYNC_SUBSCRIBE_TOKEN",
        "RTRL_MANIFEST_PUBLIC_KEYS",
    ),
}
ARGS = {"rtrl.reward_stream.replay": ("r2",)}

NOT_A_KEY = "not-a-key"
NOT_A_TOKEN = "two words"
# One malformed secret per service: each kind of secret field (private key, event key(s),
# public keys, bearer token), whether the service's own settings or the stack's hold it.
MALFORMED = [
    ("rtrl.ingest", "RTRL_INGEST_EVENT_KEY", NOT_A_KEY),
    ("rtrl.reward_stream", "RTRL_REWARD_EVENT_KEYS", NOT_A_KEY),
    ("rtrl.reward_stream.replay", "RTRL_REWARD_ROLLOUT_MAC_KEYS", NOT_A_KEY),
    ("rtrl.trainer", "RTRL_TRAINER_MANIFEST_SIGNING_KEY", NOT_A_KEY),
    ("rtrl.inference", "RTRL_INFERENCE_ROLLOUT_SIGNING_KEY", NOT_A_KEY),
    ("rtrl.weight_sync", "RTRL_WEIGHT_SYNC_TOKEN", NOT_A_TOKEN),
    ("rtrl.analytics", "RTRL_ANALYTICS_QUERY_TOKEN", NOT_A_TOKEN),
    ("rtrl.weight_sync.relay", "RTRL_WEIGHT_SYNC_SUBSCRIBE_TOKEN", "tab\there"),
    ("rtrl.inference.sglang_sidecar", "RTRL_MANIFEST_PUBLIC_KEYS", NOT_A_KEY),
]


def run(
    module: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def assert_refused(answer: subprocess.CompletedProcess[str], module: str) -> None:
    assert answer.returncode == entrypoint.USAGE_ERROR, answer.stderr
    assert answer.stderr.startswith(f"python -m {module}: invalid configuration:\n")
    assert "Traceback" not in answer.stderr


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
    assert_refused(answer, module)
    assert f"\n  {a_variable}: " in answer.stderr


@pytest.mark.parametrize("module", REQUIRED)
def test_a_service_without_its_secrets_is_refused_naming_each_and_why(module):
    """The tests' environment holds every secret (tests/conftest.py): each the service needs
    is emptied, and each is named, with what the service does with it."""
    answer = run(
        module, *ARGS.get(module, ()), env={**SIDECAR, **dict.fromkeys(REQUIRED[module], "")}
    )
    assert_refused(answer, module)
    for variable in REQUIRED[module]:
        assert f"\n  {variable}: missing: " in answer.stderr, variable
    named = [line.split(":")[0].strip() for line in answer.stderr.splitlines()[1:]]
    assert sorted(named) == sorted(REQUIRED[module]), "only the missing secrets are named"


@pytest.mark.parametrize(("module", "variable", "value"), MALFORMED)
def test_a_malformed_secret_is_refused_naming_its_variable(module, variable, value):
    answer = run(module, *ARGS.get(module, ()), env={**SIDECAR, variable: value})
    assert_refused(answer, module)
    assert f"\n  {variable}: " in answer.stderr
    assert value not in answer.stderr, "a secret is never printed, even a malformed one"


def test_a_secret_is_required_only_where_the_service_uses_it():
    stack = StackSettings(api_key_public_keys="", manifest_public_keys="")
    lenient = InferenceSettings(auth_required=False, follow_weights=False)
    assert [s.variable for s in lenient.required_secrets(stack)] == [
        "RTRL_INFERENCE_ROLLOUT_SIGNING_KEY",
        "RTRL_INFERENCE_ROLLOUT_MAC_KEY",
    ]
    sglang = InferenceSettings(
        backend="sglang", sglang_urls="treatment=http://sglang:30000", auth_required=False
    )
    assert [s.variable for s in sglang.required_secrets(stack)] == [
        "RTRL_INFERENCE_ROLLOUT_SIGNING_KEY",
        "RTRL_INFERENCE_ROLLOUT_MAC_KEY",
    ], "SGLang's sidecars follow the weights, not the worker"


def test_a_list_of_keys_that_holds_none_is_unset():
    stack = StackSettings(manifest_public_keys=" , ,")
    assert not RequiredSecret(stack, "manifest_public_keys", "workers verify with it").is_set()


def test_arguments_are_refused_since_settings_come_from_the_environment():
    answer = run("rtrl.trainer", "--batch-size", "8")
    assert answer.returncode == entrypoint.USAGE_ERROR and "see --help" in answer.stderr


def test_secrets_are_never_printed_by_help(monkeypatch):
    answer = run(
        "rtrl.trainer", "--help", env={"RTRL_TRAINER_MANIFEST_SIGNING_KEY": "do-not-print-me"}
    )
    assert "do-not-print-me" not in answer.stdout
    assert "RTRL_TRAINER_MANIFEST_SIGNING_KEY (secret" in answer.stdout
