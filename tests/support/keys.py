"""API keys made the way an operator makes them: `rtrl keys create` run in this process
(typer's CliRunner), against the Redis a test names, signed with the tests' operator key
(RTRL_API_KEY_SIGNING_KEY, which tests/conftest.py sets)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import redis
from typer.testing import CliRunner

from rtrl.api_keys import KEY_PREFIX, key_hash
from rtrl.ops.cli import app


@dataclass(frozen=True)
class CreatedKey:
    key: str
    """What the CLI printed on stdout: the key, and nothing else."""
    said: str
    """What it printed on stderr, whitespace collapsed (rich wraps lines)."""
    record: dict[str, str]
    """The key's record in Redis, as the servers read it."""

    @property
    def digest(self) -> str:
        """The key's hash, as the servers count its requests in flight."""
        return key_hash(self.key)


def run_keys(redis_url: str, state_dir: Path, *args: str):
    """``rtrl keys ARGS...`` with no stack running in ``state_dir``: the CLI uses ``redis_url``."""
    env = {"RTRL_REDIS_URL": redis_url, "RTRL_STATE_DIR": str(state_dir)}
    return CliRunner().invoke(app, ["keys", *args], env=env)


def record_of(redis_url: str, api_key: str) -> dict[str, str]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        fields = client.hgetall(KEY_PREFIX + key_hash(api_key))
        return {str(name): str(value) for name, value in fields.items()}
    finally:
        client.close()


def create_key(redis_url: str, state_dir: Path, client_id: str, *flags: str) -> CreatedKey:
    """``rtrl keys create CLIENT_ID FLAGS...``, which must succeed."""
    result = run_keys(redis_url, state_dir, "create", client_id, *flags)
    assert result.exit_code == 0, result.output
    key = result.stdout.strip()
    return CreatedKey(key, " ".join(result.stderr.split()), record_of(redis_url, key))
