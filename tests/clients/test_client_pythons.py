"""rtrl-client on every Python it supports (clients/python/pyproject.toml: requires-python
>=3.10). For each of PYTHONS, a fresh virtualenv gets rtrl-client's wheel (built once from
clients/python) with its grpc and prometheus extras, and pytest; it must then hold none of
the server's dependencies, report the version and license the source names, and pass the
client's own tests (CLIENT_TESTS). Those reach the gateway over HTTP: scripts/ingest_rig.py
runs it on this, the server's, interpreter.

The client's tests run in the main suite too, on the server's virtualenv. So they may import
nothing of the server, nor anything the client's virtualenvs lack: checked here without
running them (``test_the_client_tests_import_only_what_a_client_virtualenv_has``).
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

import rtrl_client

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
PYTHONS = ("3.10", "3.11", "3.12", "3.13")
"""The versions clients/python/pyproject.toml's classifiers name; each must be installed
(pyenv), or the test fails saying so."""
CLIENT_TESTS = ("test_python_sdk.py", "test_conformance.py", "test_client_package.py")
"""tests/clients files that test rtrl-client alone (with tests/clients/conftest.py)."""
EXTRAS = "grpc,prometheus"
TEST_TOOLS = ("pytest", "pytest-timeout")
"""Installed at the main suite's versions, so both runs use the same pytest."""
SERVER_ONLY = {"rtrl", "torch", "faust-streaming", "chdb", "numba", "confluent-kafka", "redis"}
"""What a product must not have to install to send a few events."""
CLIENT_IMPORTS = {"rtrl_client", "pytest", "aiohttp", "google", "prometheus_client", "grpc"}
"""Top-level modules the client tests may import beyond the standard library: the client,
its dependencies and extras, pytest, and ``support`` modules that themselves qualify."""


def interpreter(version: str) -> Path:
    """Python ``version`` from PATH or pyenv's versions; fails naming where it looked."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    found = [shutil.which(f"python{version}")]
    found += sorted(str(p) for p in pyenv.glob(f"versions/{version}.*/bin/python{version}"))
    for candidate in filter(None, found):
        # A pyenv shim for a version not selected is on PATH but only prints an error.
        probe = subprocess.run(
            [candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
        )
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return Path(candidate)
    pytest.fail(
        f"no Python {version} (looked on PATH and in {pyenv}/versions): rtrl-client supports "
        f"it, so its tests must run there. Install it: pyenv install {version}",
        pytrace=False,
    )


@pytest.fixture(scope="module")
def client_wheel(tmp_path_factory) -> Path:
    """rtrl-client's wheel, built once from a copy of clients/python (building in place
    would leave build/ and egg-info in the checkout): pure Python, one for every version."""
    root = tmp_path_factory.mktemp("client-wheel")
    source = shutil.copytree(
        REPO / "clients" / "python",
        root / "src",
        ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "build"),
    )
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", root / "dist", source]
    subprocess.run(build, check=True, timeout=600)
    (wheel,) = (root / "dist").glob("*.whl")
    assert wheel.name == f"rtrl_client-{rtrl_client.__version__}-py3-none-any.whl"
    return wheel


def client_venv(version: str, wheel: Path, root: Path) -> Path:
    """A virtualenv of Python ``version`` with the client, its extras and the test tools."""
    subprocess.run([interpreter(version), "-m", "venv", root / "venv"], check=True)
    python = root / "venv" / "bin" / "python"
    tools = [f"{name}=={importlib.metadata.version(name)}" for name in TEST_TOOLS]
    install: list[str | Path] = [
        python,
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
    ]
    subprocess.run([*install, f"{wheel}[{EXTRAS}]", *tools], check=True, timeout=600)
    return python


def run_client_tests(python: Path, report: Path) -> subprocess.CompletedProcess[str]:
    """The client's tests under ``python``, with the repository's pytest settings but
    tests/clients/conftest.py alone (the suite's root conftest imports the server) and
    ``tests/`` (for ``support``) instead of the checkout on sys.path."""
    pytest_bin = python.parent / "pytest"  # not `python -m pytest`: that puts the cwd on sys.path
    env = {**os.environ, "RTRL_SERVER_PYTHON": sys.executable}
    env.pop("PYTHONPATH", None)
    command: list[str | Path] = [pytest_bin, "-q", "-p", "no:cacheprovider"]
    command += ["--confcutdir", TESTS / "clients", "-o", "pythonpath=tests", "--junitxml", report]
    return subprocess.run(
        command + [TESTS / "clients" / name for name in CLIENT_TESTS],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("version", PYTHONS)
def test_the_client_installs_alone_and_passes_its_tests_on_each_python(
    version, client_wheel, tmp_path
):
    started = time.monotonic()
    python = client_venv(version, client_wheel, tmp_path)
    installed_s = time.monotonic() - started
    listed = subprocess.run(
        [python, "-m", "pip", "list", "--format", "json"], check=True, capture_output=True
    )
    installed = {package["name"].lower() for package in json.loads(listed.stdout)}
    assert "rtrl-client" in installed and {"protobuf", "aiohttp"} <= installed
    assert installed & SERVER_ONLY == set(), sorted(installed)
    named = subprocess.run(
        [python, "-I", "-c", "import importlib.metadata as m, rtrl_client, rtrl_client.v1.ingest_pb2;"
         "print(rtrl_client.__version__, m.version('rtrl-client'),"
         " m.metadata('rtrl-client')['License-Expression'])"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    assert named.stdout.split() == [rtrl_client.__version__] * 2 + ["Apache-2.0"]

    started = time.monotonic()
    run = run_client_tests(python, tmp_path / "report.xml")
    tested_s = time.monotonic() - started
    assert run.returncode == 0, (run.stdout + run.stderr)[-8000:]
    suite = ElementTree.parse(tmp_path / "report.xml").getroot().find("testsuite")
    assert suite is not None, run.stdout[-2000:]
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    print(f"\nPython {version}: {counts}; install {installed_s:.0f} s, tests {tested_s:.0f} s")
    assert counts["tests"] >= 25 and counts["failures"] == counts["errors"] == 0, counts
    assert counts["skipped"] == 0, run.stdout[-4000:]


def runtime_imports(path: Path) -> set[str]:
    """Modules ``path`` imports when run: every import but those under ``if TYPE_CHECKING``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test).endswith("TYPE_CHECKING")
        for statement in block.body
        for node in ast.walk(statement)
    }
    names = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            if node.module == "support":  # from support import wait
                names |= {f"support.{alias.name}" for alias in node.names}
    return names


def foreign_imports(paths: list[Path], support_dir: Path) -> list[str]:
    """What ``paths`` (and the ``support`` modules they reach) import beyond the standard
    library and CLIENT_IMPORTS, as ``file: module``."""
    problems, seen = [], set()
    queue = list(paths)
    while queue:
        path = queue.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in sorted(runtime_imports(path)):
            top = name.split(".")[0]
            if top == "support" and name != "support":
                queue.append(support_dir / f"{name.split('.')[1]}.py")
            elif top not in sys.stdlib_module_names and top not in CLIENT_IMPORTS | {"support"}:
                problems.append(f"{path.name}: {name}")
    return problems


def test_the_client_tests_import_only_what_a_client_virtualenv_has():
    files = [TESTS / "clients" / name for name in (*CLIENT_TESTS, "conftest.py")]
    assert foreign_imports(files, TESTS / "support") == []


def test_the_import_check_finds_the_server_directly_and_through_support(tmp_path):
    support = tmp_path / "support"
    support.mkdir()
    (support / "helper.py").write_text("import json\nfrom rtrl.procs import free_port\n")
    (support / "typed.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rtrl import procs\n"
    )
    planted = tmp_path / "test_planted.py"
    planted.write_text(
        "import redis\nimport rtrl_client\nfrom support import helper, typed\n"
        "from support.typed import x\n"
    )
    assert sorted(foreign_imports([planted], support)) == [
        "helper.py: rtrl.procs",
        "test_planted.py: redis",
    ]
