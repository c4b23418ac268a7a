"""Guarantee 10, for the wheels: what users install is what CI tested.

The server's and the client's wheels and sdists are built as they are released
(support.dists) and installed the way a user installs them, into a clean virtualenv (no
system site-packages, nothing borrowed from the dev install): torch first, then the client,
then the server, every dependency resolved by pip under constraints.txt. That install must
then hold the declared dependencies and nothing of the dev extra, import every module the
wheels ship, answer ``--help`` for every service and ``rtrl --version``, and start the
embedded stack from a directory outside the checkout.

A dependency only the dev install provides (on e9251e0: cryptography, which rtrl/signing.py
imports and only the dev extra pulled in) fails here; tests/rtrl/test_wheel.py, which
borrows the dev install's packages, cannot see it. The venv and the dists are built once
for this module: each test is one check of the same install.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import pytest

import rtrl
from support import dists
from support.dists import ok, run
from support.k8s import load_compose
from support.trainer import install_warm_start

# The first test pays for the module's install (a few minutes on a busy machine): the
# timeout counts fixtures.
pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.guarantee(10),
    pytest.mark.timeout(1200),
]

SERVICES = (
    "rtrl.ingest",
    "rtrl.reward_stream",
    "rtrl.trainer",
    "rtrl.inference",
    "rtrl.weight_sync",
    "rtrl.analytics",
    "rtrl.weight_sync.relay",
    "rtrl.inference.sglang_sidecar",
)
"""Every service's entry point (tests/rtrl/test_entrypoints.py checks what each --help says):
the embedded stack's, compose's and deploy/k8s's."""

NOT_IMPORTED = {
    # `import triton`: the gpu extra, not part of this install. The kernels package picks
    # them only on a CUDA device, after an ImportError check (kernels/__init__.py); the
    # dev install tests them under TRITON_INTERPRET.
    "rtrl.kernels.triton_delta": "gpu extra",
    "rtrl.kernels.triton_mxfp8": "gpu extra",
}
"""Modules the wheel ships that this install must not be able to import, each for a reason.
Every ``__main__`` module is run, not imported: ``--help`` below runs the services'."""


@dataclass(frozen=True)
class CleanInstall:
    venv: Path
    python: Path
    outside: Path
    """A working directory outside the checkout, so nothing is imported from it."""
    server: dists.Dists
    client: dists.Dists

    def run(self, *argv: str, timeout_s: float = 600, **env: str):
        return run(list(argv), self.venv, self.outside, timeout_s, env)

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)


@pytest.fixture(scope="module")
def install(tmp_path_factory) -> CleanInstall:
    server = dists.built("rtrl", tmp_path_factory)
    client = dists.built("rtrl-client", tmp_path_factory)
    root = tmp_path_factory.mktemp("clean-install")
    venv = root / "venv"
    python = dists.make_venv(venv)
    done = CleanInstall(venv, python, root, server, client)
    pip = [str(python), "-m", "pip", "install", "-q", "-c", str(dists.CONSTRAINTS)]
    # As pyproject.toml tells users: torch first, the build they want. This machine's pip
    # finds the CPU build of the pinned release on its own disk; elsewhere, PyTorch's CPU index.
    ok(done.run(*pip, "torch==2.13.0"))
    # The client before the server, which requires it: no index is asked for rtrl-client.
    ok(done.run(*pip, str(client.wheel)))
    ok(done.run(*pip, str(server.wheel)))
    return done


def test_the_dists_pass_twine_check(install):
    every = [install.server.wheel, install.server.sdist, install.client.wheel, install.client.sdist]
    # twine is the dev install's (a release tool): it reads the files, installs nothing.
    checked = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *map(str, every)],
        capture_output=True,
        text=True,
    )
    print(ok(checked))
    assert checked.stdout.count("PASSED") == 4, checked.stdout


def test_the_install_holds_the_declared_dependencies_pinned_and_no_dev_tool(install):
    print(ok(install.run(str(install.python), "-m", "pip", "list")))
    installed = dists.freeze(install.python, install.venv, install.outside)
    assert installed["rtrl"] == rtrl.__version__
    assert installed["rtrl-client"].startswith("0.2."), installed["rtrl-client"]
    assert not dists.dev_only() & set(installed), "a package of the dev extra was installed"
    assert dists.unpinned(installed, {"rtrl", "rtrl-client"}) == {}, (
        "installed but not pinned at this version in constraints.txt"
    )
    # The CPU build stayed: the server's torch requirement did not swap it for PyPI's CUDA build.
    assert installed["torch"].endswith("+cpu"), installed["torch"]
    assert not [name for name in installed if name.startswith(("nvidia-", "cuda-"))]


IMPORT_EVERY_MODULE = """
import importlib, json, pkgutil, sys
import rtrl, rtrl_client

skipped = set(sys.argv[1:])
seen, failed = [], {}
for package in (rtrl, rtrl_client):
    prefix = package.__name__ + "."
    onerror = lambda name: failed.setdefault(name, repr(sys.exc_info()[1]))
    for module in pkgutil.walk_packages(package.__path__, prefix, onerror=onerror):
        seen.append(module.name)
        if module.name.endswith(".__main__") or module.name in skipped:
            continue
        try:
            importlib.import_module(module.name)
        except BaseException as exc:
            failed[module.name] = repr(exc)
print(json.dumps({"seen": seen, "failed": failed, "from": [rtrl.__file__, rtrl_client.__file__]}))
"""


def test_every_module_the_wheels_ship_imports(install):
    answer = install.run(
        str(install.python), "-c", textwrap.dedent(IMPORT_EVERY_MODULE), *NOT_IMPORTED
    )
    found = json.loads(ok(answer).splitlines()[-1])
    assert found["failed"] == {}
    site = install.venv / "lib"
    assert all(Path(path).is_relative_to(site) for path in found["from"]), found["from"]
    assert set(NOT_IMPORTED) <= set(found["seen"]), "the allow-list names a module not shipped"
    assert {"rtrl.signing", "rtrl.ops.cli", "rtrl_client.client"} <= set(found["seen"])


def test_rtrl_version_and_every_services_help_answer(install):
    version = install.run(install.bin("rtrl"), "--version")
    assert ok(version).strip() == f"rtrl {rtrl.__version__}"
    compose_modules = {
        service["command"][2]
        for service in load_compose()["services"].values()
        if service.get("command", [None])[0] == "python" and service["command"][1] == "-m"
    }
    assert compose_modules <= set(SERVICES), "a service compose runs is not checked here"
    for module in SERVICES:
        answer = ok(install.run(str(install.python), "-m", module, "--help", timeout_s=120))
        assert answer.startswith(f"usage: python -m {module} [--help]"), answer[:300]


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def test_the_embedded_stack_starts_from_the_install_outside_the_checkout(install, tmp_path):
    work = tmp_path / "work"
    state = work / "state"
    # The warm start trained once (by tests/support) and copied: training it is the CLI's
    # own business, tested with the demo; here the point is what the install starts.
    install_warm_start(state)
    env = {
        "RTRL_STATE_DIR": str(state),
        "RTRL_STACK_INFERENCE_WORKERS": "1",
        # Nothing listens on port 9: were any process to use this instead of the stack's
        # own Redis, it would fail, not find someone's Redis on 6379.
        "RTRL_REDIS_URL": "redis://127.0.0.1:9/0",
    }
    work.mkdir(exist_ok=True)
    rtrl_cli = install.bin("rtrl")
    try:
        started = run([rtrl_cli, "up"], install.venv, work, 600, env)
        ok(started)
        status = json.loads(ok(run([rtrl_cli, "status", "--json"], install.venv, work, 120, env)))
        assert status["healthy"], [c for c in status["components"] if not c["healthy"]]
        stack = json.loads((state / "stack.json").read_text())
        redis_port = urllib.parse.urlsplit(stack["redis_url"]).port
        assert redis_port != 6379
        # The stack's own redis-server (its process title names its address), keeping its
        # data in the state directory (its working directory is its --dir).
        redis_pid = stack["infra"]["redis"]
        title = _cmdline(redis_pid)[0]
        assert title.split()[0].endswith("redis-server") and title.endswith(f":{redis_port}")
        assert Path(os.readlink(f"/proc/{redis_pid}/cwd")).is_relative_to(state.resolve())
        # Every service runs on the clean install's interpreter.
        for service in stack["services"]:
            assert _cmdline(service["pid"])[0] == str(install.python), service["name"]
    finally:
        stopped = run([rtrl_cli, "down"], install.venv, work, 180, env)
    assert "stack stopped" in ok(stopped), stopped.stdout
    assert not (state / "stack.json").exists()
