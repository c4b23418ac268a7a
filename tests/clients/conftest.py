"""Fixtures of the client tests: the real gateway as a process of its own, and a key for it."""

import pytest

from support.gateway import GatewayProcess, issue


@pytest.fixture
def gateway(stack_env, repo_root, tmp_path):
    # A killed gateway's claims expire after claim_ttl_s; 3 s keeps the fault tests short.
    process = GatewayProcess(
        stack_env, repo_root, tmp_path / "ingest.log", claim_ttl_s=3, produce_timeout_ms=2000
    )
    process.start()
    yield process
    process.stop()


@pytest.fixture
def api_key(redis_url) -> str:
    return issue(redis_url, "sdk-test")
