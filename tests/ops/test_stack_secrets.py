"""The embedded stack's secrets (ops/stack_secrets.py): generated once, owner-only, and
each service's environment built from an allow-list, never the operator's whole one."""

from __future__ import annotations

import os
from dataclasses import fields

import pytest

from rtrl import signing
from rtrl.ops import stack_secrets
from rtrl.ops.stack_secrets import SERVICE_SECRETS, StackSecrets, service_env

OPERATOR = {
    "PATH": "/usr/bin",
    "HOME": "/root",
    "AWS_SECRET_ACCESS_KEY": "aws-secret",  # the operator's, for nothing rtrl runs here
    "GITHUB_TOKEN": "gh-secret",
    "RTRL_WEIGHT_SYNC_TOKEN": "operator-publish-token",  # a secret from the operator's shell
    "RTRL_KAFKA_BOOTSTRAP": "127.0.0.1:9092",  # a shared, non-secret setting
    "RTRL_TRAINER_LR": "0.0002",  # the trainer's own setting
    "RTRL_INGEST_MAX_BATCH": "10",
}


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
    env = service_env(service, OPERATOR, secrets)
    held = {name for name, value in vars(secrets).items() if value in env.values()}
    assert held == set(SERVICE_SECRETS.get(service, {}).values())
    assert not {"aws-secret", "gh-secret", "operator-publish-token"} & set(env.values())
    assert env["PATH"] == "/usr/bin" and env["RTRL_KAFKA_BOOTSTRAP"] == "127.0.0.1:9092"
    assert ("RTRL_TRAINER_LR" in env) is (service == "trainer")
    assert ("RTRL_INGEST_MAX_BATCH" in env) is (service == "ingest")
    # The trainer verifies rewards with the joiner's public key; only the joiner holds the private one.
    assert ("RTRL_TRAINER_REWARD_PUBLIC_KEYS" in env) is (service == "trainer")
    if service == "trainer":
        assert env["RTRL_TRAINER_REWARD_PUBLIC_KEYS"] == signing.public_key_of(
            secrets.reward_signing_key
        )
    # The gateway and the serving API verify key records with the operator's public key; no service signs them.
    assert ("RTRL_API_KEY_PUBLIC_KEYS" in env) is (service in ("ingest", "inference"))
    assert secrets.api_key_signing_key not in env.values()
    # Workers verify manifests with the trainer's public key; only the trainer holds the private one.
    assert ("RTRL_MANIFEST_PUBLIC_KEYS" in env) is (service in ("trainer", "inference"))
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
