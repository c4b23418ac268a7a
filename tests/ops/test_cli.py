"""The CLI finds the stack running in RTRL_STATE_DIR and says which; it never falls
back to a default Redis address, where any Redis may listen."""

from __future__ import annotations

import os
import time
import urllib.parse

import pytest
import redis
from typer.testing import CliRunner

from rtrl.ops.cli import app
from rtrl.ops.stack import StackFile, stack_path


def _pretend_stack(state_dir, redis_url) -> StackFile:
    """A stack file whose supervisor is this process: the CLI sees a running stack."""
    stack = StackFile(
        supervisor_pid=os.getpid(),
        state_dir=str(state_dir),
        kafka_bootstrap="127.0.0.1:1",
        redis_url=redis_url,
        clickhouse_url=f"chdb://{state_dir / 'chdb'}",
        weight_sync_addr="127.0.0.1:1",
        infra={},
        services=[],
        started_ts=time.time(),
    )
    state_dir.mkdir(parents=True, exist_ok=True)
    stack.write(stack_path(state_dir))
    return stack


def _clients(redis_url) -> list[str]:
    client = redis.Redis.from_url(redis_url)
    try:
        return [row["client_id"] for row in _key_rows(client)]
    finally:
        client.close()


def _key_rows(client) -> list[dict]:
    rows = []
    for key in client.scan_iter("rtrl:ingest:key:*"):
        if client.type(key) == b"hash":
            rows.append({k.decode(): v.decode() for k, v in client.hgetall(key).items()})
    return rows


@pytest.fixture
def embedded_redis(tmp_path):
    """A state directory's secrets and its Redis, started as `rtrl up` starts it: the
    stack's users only (ops/redis_acl.py). Yields the state directory and Redis's address."""
    from rtrl.ops import redis_acl, stack_secrets

    state_dir = tmp_path / "state"
    state_dir.mkdir()
    passwords = stack_secrets.ensure(state_dir).redis_passwords()
    proc = redis_acl.start(state_dir, passwords, state_dir / "logs" / "redis.log")
    yield state_dir, f"redis://127.0.0.1:{proc.port}/0"
    proc.stop()


def test_keys_go_to_the_running_stacks_redis_even_when_rtrl_redis_url_points_elsewhere(
    embedded_redis, monkeypatch
):
    state_dir, address = embedded_redis
    stack = _pretend_stack(state_dir, address)
    monkeypatch.setenv("RTRL_STATE_DIR", str(state_dir))
    monkeypatch.setenv("RTRL_REDIS_URL", "redis://127.0.0.1:1/0")  # nothing listens there
    result = CliRunner().invoke(app, ["keys", "create", "product-a"])
    assert result.exit_code == 0, result.output
    assert f"using the stack in {state_dir}" in " ".join(result.output.split())
    # As the operator, whose password the CLI read from the state directory and never printed.
    operator = stack.redis_url_as("operator")
    assert "product-a" in _clients(operator)
    password = urllib.parse.urlsplit(operator).password
    assert password and password not in result.output


def test_keys_without_a_running_stack_or_a_redis_url_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("RTRL_STATE_DIR", str(tmp_path / "nothing-here"))
    monkeypatch.delenv("RTRL_REDIS_URL", raising=False)
    result = CliRunner().invoke(app, ["keys", "create", "product-a"])
    assert result.exit_code == 1
    said = " ".join(result.output.split())
    assert "no stack running" in said and "RTRL_REDIS_URL" in said


def test_keys_without_a_stack_use_an_explicit_redis_url(tmp_path, redis_url, monkeypatch):
    monkeypatch.setenv("RTRL_STATE_DIR", str(tmp_path / "nothing-here"))
    monkeypatch.setenv("RTRL_REDIS_URL", redis_url)
    result = CliRunner().invoke(app, ["keys", "create", "product-b"])
    assert result.exit_code == 0, result.output
    assert "product-b" in _clients(redis_url)


@pytest.mark.parametrize("command", [["up"], ["demo", "--minutes", "0.1"]])
def test_up_and_demo_refuse_a_directory_that_is_not_a_state_directory(
    tmp_path, monkeypatch, command
):
    (tmp_path / "thesis.tex").write_text("years of work")
    monkeypatch.setenv("RTRL_STATE_DIR", str(tmp_path))
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 1
    assert "not an rtrl state directory" in " ".join(result.output.split())
    assert [p.name for p in tmp_path.iterdir()] == ["thesis.tex"]
