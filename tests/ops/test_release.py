"""What a release ships is one thing: the server (rtrl), the Python client (rtrl-client) and
the TypeScript client (@rtrl/client) carry one version, the server depends on the client of
its own minor, ``rtrl --version`` says it, and every package in the repository is licensed
under the one license of LICENSE, by its SPDX identifier."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

import rtrl
import rtrl_client

REPO = Path(__file__).resolve().parents[2]
LICENSE = "Apache-2.0"
UNPUBLISHED = {"deploy/grafana/package.json": "the dashboards' schema check: a tool, not a package"}
"""package.json files that are ``private`` (npm refuses to publish them), and why."""


def manifests(root: Path) -> list[Path]:
    """Every pyproject.toml and package.json of the repository, installed copies aside."""
    found = []
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = [
            d
            for d in subdirectories
            if not d.startswith(".") and d not in ("node_modules", "build", "dist")
        ]
        found += [Path(directory) / f for f in files if f in ("pyproject.toml", "package.json")]
    return sorted(found)


def versions() -> dict[str, str]:
    typescript = json.loads((REPO / "clients/typescript/package.json").read_text())
    lock = json.loads((REPO / "clients/typescript/package-lock.json").read_text())
    generated = (REPO / "clients/typescript/src/version.ts").read_text()
    return {
        "rtrl (rtrl/__init__.py)": rtrl.__version__,
        "rtrl-client (rtrl_client/version.py)": rtrl_client.__version__,
        "@rtrl/client (package.json)": typescript["version"],
        "@rtrl/client (package-lock.json)": lock["packages"][""]["version"],
        "@rtrl/client (src/version.ts)": generated.split('VERSION = "')[1].split('"')[0],
    }


def test_every_package_has_the_servers_version():
    found = versions()
    assert set(found.values()) == {rtrl.__version__}, found


def test_the_server_depends_on_the_client_of_its_own_minor():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (client,) = [
        Requirement(d) for d in project["dependencies"] if Requirement(d).name == "rtrl-client"
    ]
    assert client.specifier.contains(rtrl_client.__version__), client
    major, minor, *_ = rtrl.__version__.split(".")
    assert not client.specifier.contains(f"{major}.{int(minor) + 1}.0"), client


def test_rtrl_version_prints_the_servers_version():
    printed = subprocess.run(
        [sys.executable, "-m", "rtrl", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert printed.stdout == f"rtrl {rtrl.__version__}\n"


def license_problems(root: Path) -> list[str]:
    """Each manifest under ``root`` whose license is not LICENSE, in SPDX form (a pyproject
    also needs setuptools>=77 to build it), and each private package.json not UNPUBLISHED."""
    problems = []
    for path in manifests(root):
        name = path.relative_to(root).as_posix()
        if path.name == "pyproject.toml":
            document = tomllib.loads(path.read_text())
            if document.get("project", {}).get("license") != LICENSE:
                problems.append(f"{name}: license is not the string {LICENSE!r}")
            if "setuptools>=77" not in document.get("build-system", {}).get("requires", []):
                problems.append(f"{name}: SPDX license strings need setuptools>=77 to build")
            continue
        package = json.loads(path.read_text())
        lock = path.with_name("package-lock.json")
        locked = json.loads(lock.read_text())["packages"][""] if lock.exists() else package
        if package.get("license") != LICENSE or locked.get("license") != LICENSE:
            problems.append(f"{name}: license is not {LICENSE!r} (in the lock file too)")
        if package.get("private") and name not in UNPUBLISHED:
            problems.append(f"{name}: private, so it can never be published")
    return problems


def test_every_package_is_licensed_apache_2_and_ships_the_license_text():
    assert license_problems(REPO) == []
    found = {p.relative_to(REPO).as_posix() for p in manifests(REPO)}
    assert {"pyproject.toml", "clients/python/pyproject.toml"} <= found
    assert {"clients/typescript/package.json", *UNPUBLISHED} <= found
    # The published packages carry the license's text (the wheel and the npm tarball take
    # a LICENSE beside their manifest).
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0" in text
    for package in ("clients/python", "clients/typescript"):
        assert (REPO / package / "LICENSE").read_text() == text, package


def test_the_license_check_finds_each_kind_of_mistake(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=69"]\n[project]\nlicense = { text = "MIT" }\n'
    )
    (tmp_path / "web").mkdir()
    (tmp_path / "web/package.json").write_text('{"license": "Apache-2.0", "private": true}')
    (tmp_path / "web/package-lock.json").write_text('{"packages": {"": {"license": "MIT"}}}')
    (tmp_path / "node_modules/x").mkdir(parents=True)  # an installed copy: not ours
    (tmp_path / "node_modules/x/package.json").write_text('{"license": "MIT"}')
    assert license_problems(tmp_path) == [
        "pyproject.toml: license is not the string 'Apache-2.0'",
        "pyproject.toml: SPDX license strings need setuptools>=77 to build",
        "web/package.json: license is not 'Apache-2.0' (in the lock file too)",
        "web/package.json: private, so it can never be published",
    ]
