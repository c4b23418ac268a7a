"""What `docker compose` would read from an operator's environment, and compose/compose.yaml
read with it: shared by the tests of compose (tests/ops/test_compose.py) and of the secrets
it keeps off command lines (tests/ops/test_secrets_off_command_lines.py)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from rtrl import signing

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "compose" / "compose.yaml"

REDIS_USERS = (
    "operator",
    "ingest",
    "inference",
    "weight_sync",
    "trainer",
    "reward_stream",
    "analytics",
)
KAFKA_USERS = ("admin", "ingest", "inference", "reward_stream", "trainer", "analytics")
# What `docker compose` would read from the operator's environment.
OPERATOR_ENV = {
    "RTRL_WEIGHT_SYNC_TOKEN": "publish-secret",
    "RTRL_WEIGHT_SYNC_SUBSCRIBE_TOKEN": "subscribe-secret",
    "RTRL_ANALYTICS_QUERY_TOKEN": "query-secret",
    # Keys of the shape their settings check (rtrl/config.py), each its own value.
    # Each reward reader's MAC key: the joiner's copy and the reader's, two values here.
    "RTRL_REWARD_TRAINER_MAC_KEY": signing.generate_mac_key(),
    "RTRL_TRAINER_REWARD_MAC_KEYS": signing.generate_mac_key(),
    "RTRL_REWARD_ANALYTICS_MAC_KEY": signing.generate_mac_key(),
    "RTRL_ANALYTICS_REWARD_MAC_KEYS": signing.generate_mac_key(),
    "RTRL_TRAINER_MANIFEST_SIGNING_KEY": signing.generate_private_key(),
    "RTRL_INFERENCE_ROLLOUT_SIGNING_KEY": signing.generate_private_key(),
    # One key in truth (the gateway authenticates, the joiner verifies): two names, two values here.
    "RTRL_INGEST_EVENT_KEY": signing.generate_mac_key(),
    "RTRL_REWARD_EVENT_KEYS": signing.generate_mac_key(),
    # So are the rollouts' MAC key (workers, joiner) and the sink's event key (gateway, sink).
    "RTRL_INFERENCE_ROLLOUT_MAC_KEY": signing.generate_mac_key(),
    "RTRL_REWARD_ROLLOUT_MAC_KEYS": signing.generate_mac_key(),
    "RTRL_INGEST_ANALYTICS_EVENT_KEY": signing.generate_mac_key(),
    "RTRL_ANALYTICS_EVENT_KEYS": signing.generate_mac_key(),
    "RTRL_SGLANG_API_KEY": "sglang-serving-secret",
    "RTRL_SGLANG_ADMIN_API_KEY": "sglang-admin-secret",
    **{f"RTRL_REDIS_PASSWORD_{user.upper()}": f"redis-{user}-secret" for user in REDIS_USERS},
    "RTRL_GRAFANA_ADMIN_PASSWORD": "grafana-admin-secret",
    "RTRL_CLICKHOUSE_SINK_PASSWORD": "ch-writer-pw",
    "RTRL_CLICKHOUSE_QUERY_PASSWORD": "ch-reader-pw",
    **{f"RTRL_KAFKA_PASSWORD_{user.upper()}": f"kafka-{user}-pw" for user in KAFKA_USERS},
}
# Secrets only compose has (the embedded stack runs no SGLang; its services' Redis passwords
# reach them inside RTRL_REDIS_URL, not through SERVICE_SECRETS), by the module that uses
# them: each service's Redis password is its own.
COMPOSE_ONLY_SECRETS = {
    "inference": {"RTRL_SGLANG_API_KEY"},
    "inference.sglang_sidecar": {
        "RTRL_WEIGHT_SYNC_SUBSCRIBE_TOKEN",
        "RTRL_SGLANG_API_KEY",
        "RTRL_SGLANG_ADMIN_API_KEY",
    },
}
for _user in REDIS_USERS[1:]:
    COMPOSE_ONLY_SECRETS.setdefault(_user, set()).add(f"RTRL_REDIS_PASSWORD_{_user.upper()}")
COMPOSE_ONLY_SECRETS["analytics"] |= {
    "RTRL_CLICKHOUSE_SINK_PASSWORD",
    "RTRL_CLICKHOUSE_QUERY_PASSWORD",
}
for _user in KAFKA_USERS[1:]:
    COMPOSE_ONLY_SECRETS[_user].add(f"RTRL_KAFKA_PASSWORD_{_user.upper()}")
# Not secret, but required: workers verify manifests with the trainer's public key, the
# analytics sink rollouts with the workers'.
OPERATOR_CONFIG = {
    "RTRL_MANIFEST_PUBLIC_KEYS": signing.public_key_of(
        OPERATOR_ENV["RTRL_TRAINER_MANIFEST_SIGNING_KEY"]
    ),
    "RTRL_ANALYTICS_ROLLOUT_PUBLIC_KEYS": signing.public_key_of(
        OPERATOR_ENV["RTRL_INFERENCE_ROLLOUT_SIGNING_KEY"]
    ),
    "RTRL_API_KEY_PUBLIC_KEYS": signing.public_key_of(signing.generate_private_key()),
}


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error} against ``env``."""

    def value(match: re.Match) -> str:
        name, op, arg = match.group(1), match.group(2), match.group(3) or ""
        if name in env and (env[name] or op is None):
            return env[name]
        if op == ":?":
            raise KeyError(f"compose needs ${name}: {arg}")
        return arg if op == ":-" else ""

    return re.sub(r"\$\{(\w+)(?:(:-|:\?)([^}]*))?\}", value, text)


def load(env: dict[str, str] = OPERATOR_ENV | OPERATOR_CONFIG) -> dict:
    return yaml.safe_load(interpolate(COMPOSE.read_text(), env))
