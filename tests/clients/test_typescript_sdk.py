"""The TypeScript SDK (clients/typescript) under `make test`: its own suite (`npm test`, Node's
test runner, against real gateways it starts through scripts/ingest_rig.py) must pass, and
regenerating its protobuf code from proto/ must change nothing. `make install` runs `npm ci`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "clients" / "typescript"
# Fewer than this many passing tests means files were dropped or never ran.
MIN_NODE_TESTS = 25


def _npm(*args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    npm = shutil.which("npm")
    assert npm is not None, "npm is not on PATH: install Node 20 (see clients/typescript/README.md)"
    assert (PACKAGE / "node_modules").is_dir(), (
        "clients/typescript has no node_modules: make install"
    )
    # The rig runs on this interpreter: the venv's, with rtrl and rtrl_client importable.
    env = {**os.environ, "RTRL_PYTHON": sys.executable}
    return subprocess.run(
        [npm, *args],
        cwd=PACKAGE,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


@pytest.mark.integration
@pytest.mark.slow
def test_the_node_suite_passes_against_real_gateways():
    run = _npm("test", timeout_s=240)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-8000:]
    passed = re.search(r"^# pass (\d+)$", run.stdout, re.MULTILINE)
    failed = re.search(r"^# fail (\d+)$", run.stdout, re.MULTILINE)
    assert passed and failed, output[-4000:]
    assert int(failed.group(1)) == 0 and int(passed.group(1)) >= MIN_NODE_TESTS, output[-4000:]


def test_regenerating_the_typescript_protobuf_code_changes_nothing():
    run = _npm("run", "check-generated", timeout_s=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "src/gen matches the generator" in run.stdout
