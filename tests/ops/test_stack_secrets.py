"""The embedded stack's secrets (ops/stack_secrets.py): generated once, owner-only, and
each service's environment built from an allow-list, never the operator's whole one; each
service reaches Redis as its own user (ops/redis_acl.py), and stack.json holds no password."""

from __future__ import annotations

import json
import os
import urllib.parse
from dataclasses import asdict, fields, replace

import pytest

from rtrl import signing
from rtrl.ops import redis_acl, stack_secrets
from rtrl.ops.stack import StackFile
from rtrl.ops.stack_secrets import SERVICE_PREFIX, StackSecrets, service_env

OPERATOR = {
    "PATH": "/usr/bin",
    "HOME": "/root",
    "AWS_SECRET_ACCESS_KEY": "aws-secret",  # the operator's, for nothing rtrl runs here
    "GITHUB_TOKEN": "gh-secret",
    "RTRL_WEIGHT_SYNC_TOKEN": "operator-publish-token",  # a secret from the operator's shell
    "RTRL_KAFKA_BOOTSTRAP": "127.0.0.1:9092",  # a shared, non-secret setting
    "RTRL_REDIS_URL": "redis://127.0.0.1:6379/0",  # some other Redis, with no password
    "RTRL_TRAINER_LR": "0.0002",  # the trainer's own setting
    "RTRL_INGEST_MAX_BATCH": "10",
}
# Where the stack's Redis listens (stack.json's redis_url): no credentials.
REDIS_ADDRESS = "redis://127.0.0.1:41234/0"


def test_secrets_are_generated_once_owner_only_and_kept(tmp_path):
    first = stack_secrets.ensure(tmp_path)
    path = tmp_path / stack_secrets.SECRETS_FILE
    assert path.stat().st_mode & 0o777 == 0o600
    assert stack_secrets.ensure(tmp_path) == first == stack_secrets.load(tmp_path)
    assert len(set(first.values())) == len(fields(StackSecrets)) and all(
        len(value) >= 40 for value in first.values()
    )
    (tmp_path / "other").mkdir()
    assert stack_secrets.ensure(tmp_path / "other") != first, (
        "another state directory, other secrets"
    )


def test_a_secrets_file_others_can_read_is_refused(tmp_path):
    stack_secrets.ensure(tmp_path)
    os.chmod(tmp_path / stack_secrets.SECRETS_FILE, 0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        stack_secrets.load(tmp_path)


@pytest.mark.parametrize(
    "service", ["analytics", "weight_sync", "trainer", "inference", "ingest", "reward_stream"]
)
def test_each_service_gets_its_settings_and_its_own_secrets_only(service):
    secrets = StackSecrets.generate()
    env = service_env(service, OPERATOR, secrets, REDIS_ADDRESS)
    # Held under any name, whole or inside a value (a password inside RTRL_REDIS_URL).
    held = {name for name, value in vars(secrets).items() if any(value in v for v in env.values())}
    assert held == stack_secrets.held_by(service)
    assert f"redis_password_{service}" in held
    # Its own Redis user on the stack's Redis, never the operator's RTRL_REDIS_URL.
    redis_url = urllib.parse.urlsplit(env["RTRL_REDIS_URL"])
    assert (redis_url.username, redis_url.password) == (
        service,
        secrets.redis_passwords()[service],
    )
    assert redis_url._replace(netloc=redis_url.netloc.split("@")[1]).geturl() == REDIS_ADDRESS
    assert not {"aws-secret", "gh-secret", "operator-publish-token"} & set(env.values())
    assert env["PATH"] == "/usr/bin" and env["RTRL_KAFKA_BOOTSTRAP"] == "127.0.0.1:9092"
    assert ("RTRL_TRAINER_LR" in env) is (service == "trainer")
    assert ("RTRL_INGEST_MAX_BATCH" in env) is (service == "ingest")
    # Each reader of rewards holds its own MAC key, which only the joiner shares.
    assert ("RTRL_TRAINER_REWARD_MAC_KEYS" in env) is (service == "trainer")
    assert ("RTRL_ANALYTICS_REWARD_MAC_KEYS" in env) is (service == "analytics")
    holders = {
        secrets.reward_trainer_mac_key: {"trainer", "reward_stream"},
        secrets.reward_analytics_mac_key: {"analytics", "reward_stream"},
        secrets.rollout_mac_key: {"inference", "reward_stream"},
        secrets.event_mac_key: {"ingest", "reward_stream"},
        secrets.analytics_event_mac_key: {"ingest", "analytics"},
    }
    for key, services in holders.items():
        assert (key in env.values()) is (service in services), (service, services)
    # The gateway and the serving API verify key records with the operator's public key; no service signs them.
    assert ("RTRL_API_KEY_PUBLIC_KEYS" in env) is (service in ("ingest", "inference"))
    assert secrets.api_key_signing_key not in env.values()
    # Workers verify manifests with the trainer's public key, the sink its steps; only the trainer signs.
    assert ("RTRL_MANIFEST_PUBLIC_KEYS" in env) is (
        service in ("trainer", "inference", "analytics")
    )
    if "RTRL_MANIFEST_PUBLIC_KEYS" in env:
        assert env["RTRL_MANIFEST_PUBLIC_KEYS"] == signing.public_key_of(
            secrets.manifest_signing_key
        )


def test_the_operators_key_authority_is_the_stacks_own_else_the_environments(tmp_path, monkeypatch):
    from rtrl.api_keys import KeyVerifier

    def signs_for(authority, private_key: str) -> bool:
        fields = authority.signed("d" * 64, {"client_id": "c", "scopes": "*"})
        return KeyVerifier([signing.public_key_of(private_key)]).problem("d" * 64, fields) is None

    production = signing.generate_private_key()
    monkeypatch.setenv(stack_secrets.API_KEY_SIGNING_VARIABLE, production)
    assert signs_for(stack_secrets.key_authority(tmp_path), production)  # no stack here
    embedded = stack_secrets.ensure(tmp_path)
    assert signs_for(stack_secrets.key_authority(tmp_path), embedded.api_key_signing_key)
    monkeypatch.delenv(stack_secrets.API_KEY_SIGNING_VARIABLE)
    with pytest.raises(RuntimeError, match="API keys cannot be signed"):
        stack_secrets.key_authority(tmp_path / "elsewhere")


def test_every_redis_user_has_a_password_and_every_service_is_a_redis_user():
    users = {user.name for user in redis_acl.USERS}
    assert set(StackSecrets.generate().redis_passwords()) == users
    assert set(SERVICE_PREFIX) | {"operator"} == users


def test_a_secrets_file_from_before_the_redis_users_gains_their_passwords(tmp_path):
    """`_completed`: a state directory from an older rtrl keeps its secrets and gets the
    Redis passwords it lacks, once."""
    older = {
        name: value
        for name, value in asdict(StackSecrets.generate()).items()
        if not name.startswith("redis_password_")
    }
    path = tmp_path / stack_secrets.SECRETS_FILE
    path.write_text(json.dumps(older))
    path.chmod(0o600)
    completed = stack_secrets.ensure(tmp_path)
    assert {name: vars(completed)[name] for name in older} == older
    assert all(len(p) >= 40 for p in completed.redis_passwords().values())
    assert stack_secrets.ensure(tmp_path) == completed
    assert path.stat().st_mode & 0o777 == 0o600


def test_stack_json_holds_where_redis_listens_and_the_operator_adds_its_password(tmp_path):
    """stack.json is read by every client of the stack: it names no Redis password, and no
    RTRL_REDIS_URL it would hand to every service; the operator's comes from secrets.json."""
    secrets = stack_secrets.ensure(tmp_path)
    stack = StackFile(
        supervisor_pid=os.getpid(),
        state_dir=str(tmp_path),
        kafka_bootstrap="127.0.0.1:1",
        redis_url=REDIS_ADDRESS,
        clickhouse_url="chdb:///nowhere",
        weight_sync_addr="127.0.0.1:2",
        infra={},
        services=[],
        started_ts=0.0,
    )
    stack.write(tmp_path / "stack.json")
    written = (tmp_path / "stack.json").read_text()
    assert not [p for p in secrets.values() if p in written]
    assert "RTRL_REDIS_URL" not in stack.env()
    operator = urllib.parse.urlsplit(stack.redis_url_as("operator"))
    assert (operator.username, operator.password, operator.port) == (
        "operator",
        secrets.redis_passwords()["operator"],
        41234,
    )
    # No secrets, no Redis: never a client without a password (nor a default address).
    with pytest.raises(RuntimeError, match=stack_secrets.SECRETS_FILE):
        replace(stack, state_dir=str(tmp_path / "elsewhere")).redis_url_as("operator")
