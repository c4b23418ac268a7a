"""The project's distributions as users get them, and clean virtualenvs to install them in.

The wheels and sdists are built by ``python -m build`` from a copy of the checkout's files
(git's list, symlinks kept), so a stale ``build/`` in the checkout can neither help nor hurt
them; the wheel is built from the sdist, so what the sdist leaves out is missing from the
wheel too. ``--no-isolation``: the build backend is the dev install's, pinned by
constraints.txt, not whatever an isolated build would fetch. Each is built once per test
session (``built``), whichever test module asks first.

A virtualenv made here has no system site-packages and borrows nothing: the processes run
in it get an environment without the dev install's virtualenv, PYTHONPATH or the test
run's secrets, and a working directory outside the checkout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONSTRAINTS = REPO / "constraints.txt"
PROJECTS = {"rtrl": Path("."), "rtrl-client": Path("clients/python")}
"""Each distribution and where its pyproject.toml is, in the checkout."""


def checkout_copy(dest: Path) -> Path:
    """The files git lists (tracked, and untracked but not ignored) copied to ``dest``,
    symlinks as symlinks."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        check=True,
        capture_output=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if not source.exists() and not source.is_symlink():
            continue  # deleted in the work tree, not yet in git's index
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target, follow_symlinks=False)
    return dest


@dataclass(frozen=True)
class Dists:
    """One project's release: its wheel and its sdist."""

    wheel: Path
    sdist: Path


def build(project_dir: Path, out: Path) -> Dists:
    done = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(project_dir)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return Dists(wheel, sdist)


_built: dict[str, Dists] = {}
_source: list[Path] = []


def built(project: str, tmp_path_factory: pytest.TempPathFactory) -> Dists:
    """``project``'s dists (a key of PROJECTS), built the first time any test of this
    session asks, from one copy of the checkout."""
    if project not in _built:
        if not _source:
            _source.append(checkout_copy(tmp_path_factory.mktemp("checkout")))
        out = tmp_path_factory.mktemp(f"dist-{project}")
        _built[project] = build(_source[0] / PROJECTS[project], out)
    return _built[project]


def pins(path: Path = CONSTRAINTS) -> dict[str, str]:
    """constraints.txt as {normalized name: version}."""
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            found[normalized(name)] = version
    return found


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def clean_env(venv: Path) -> dict[str, str]:
    """This process's environment as a user's shell would have it with ``venv`` activated:
    no variable of the test run's (its secrets, RTRL_*, TRITON_INTERPRET), no dev virtualenv
    on PATH. pip keeps this machine's configuration (its indexes), as a user's pip would."""
    dev_bin = str(Path(sys.prefix) / "bin")
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != dev_bin]
    dropped = {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "TRITON_INTERPRET", "PYTEST_ADDOPTS"}
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in dropped and not name.startswith(("RTRL_", "PYTEST_", "COV_"))
    }
    env["PATH"] = os.pathsep.join([str(venv / "bin"), *path])
    env["VIRTUAL_ENV"] = str(venv)
    return env


def make_venv(venv: Path) -> Path:
    """A fresh virtualenv at ``venv`` (its own pip, no system site-packages); its python."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    return venv / "bin" / "python"


def run(
    argv: list[str],
    venv: Path,
    cwd: Path,
    timeout_s: float = 600,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``argv`` in ``venv``'s clean environment (plus ``env``), from ``cwd``; the answer
    whatever its exit status."""
    return subprocess.run(
        argv,
        cwd=cwd,
        env={**clean_env(venv), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def ok(answer: subprocess.CompletedProcess[str]) -> str:
    """The stdout of a command that must have succeeded (else its output, to read)."""
    assert answer.returncode == 0, (
        f"{answer.args} exited {answer.returncode}\n"
        f"{answer.stdout[-3000:]}\n{answer.stderr[-5000:]}"
    )
    return answer.stdout


def freeze(python: Path, venv: Path, cwd: Path) -> dict[str, str]:
    """What ``venv`` holds, {normalized name: version}, pip itself included."""
    listed = ok(run([str(python), "-m", "pip", "list", "--format", "json"], venv, cwd))
    return {normalized(row["name"]): row["version"] for row in json.loads(listed)}


def unpinned(installed: dict[str, str], ours: set[str]) -> dict[str, str]:
    """What ``installed`` holds that constraints.txt does not pin at that version, besides
    pip and the project's own distributions ``ours``. torch's local label (+cpu) is the
    build, not the version."""
    pinned = pins()
    return {
        name: version
        for name, version in installed.items()
        if name not in ours | {"pip"} and pinned.get(name) != version.split("+")[0]
    }


def dev_only(pyproject: Path = REPO / "pyproject.toml") -> set[str]:
    """The dev extra's packages that no runtime dependency or other extra names: none of
    them belongs in an install of the wheel."""
    import tomllib

    project = tomllib.loads(pyproject.read_text())["project"]
    extras = project["optional-dependencies"]

    def names(requirements: list[str]) -> set[str]:
        return {normalized(re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0]) for r in requirements}

    shipped = names(project["dependencies"]).union(
        *(names(r) for extra, r in extras.items() if extra != "dev")
    )
    return names(extras["dev"]) - shipped - {"rtrl"}
