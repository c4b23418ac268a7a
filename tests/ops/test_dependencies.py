"""Every import of the shipped code is a declared dependency of the wheel (deptry, configured
in pyproject.toml's [tool.deptry] and run by `make lint`), and the check sees what it must:
an import planted in a copy of the checkout, in rtrl/ or in a service folder rtrl/ links to,
of a package nothing declares, of one only installed as another's dependency, or of one only
the dev extra declares."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support import dists


def deptry(root: Path, tmp_path: Path) -> tuple[int, list[dict]]:
    """deptry's exit status on ``root`` (its own pyproject.toml) and the issues it found."""
    report = tmp_path / "deptry.json"
    done = subprocess.run(
        [sys.executable, "-m", "deptry", ".", "--json-output", str(report)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.returncode, json.loads(report.read_text()) if report.exists() else []


def test_every_import_of_the_shipped_code_is_declared(tmp_path):
    status, issues = deptry(dists.REPO, tmp_path)
    assert (status, issues) == (0, [])


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    return dists.checkout_copy(tmp_path_factory.mktemp("checkout"))


PLANTED = [
    # A package no one declares, in the foundation.
    ("rtrl/zz_planted.py", "import leftpad_never_declared\n", "DEP001", "leftpad_never_declared"),
    # Installed only because another dependency needs it (the cause on e9251e0: cryptography
    # came through the dev extra), in a service folder rtrl/ links to.
    ("trainer/zz_planted.py", "import requests\n", "DEP003", "requests"),
    # Declared by the dev extra only: shipped code may not need it.
    ("ops/zz_planted.py", "def f():\n    import pytest\n", "DEP004", "pytest"),
]


@pytest.mark.parametrize(("path", "source", "code", "module"), PLANTED)
def test_a_planted_undeclared_import_is_flagged(checkout, tmp_path, path, source, code, module):
    planted = checkout / path
    planted.write_text(source)
    try:
        status, issues = deptry(checkout, tmp_path)
    finally:
        planted.unlink()
    assert status == 1
    assert [(i["error"]["code"], i["module"], i["location"]["file"]) for i in issues] == [
        (code, module, path)
    ]


def test_a_declaration_taken_away_is_flagged_where_it_is_imported(checkout, tmp_path):
    """e9251e0's pyproject.toml: cryptography, which rtrl/signing.py imports, undeclared."""
    pyproject = checkout / "pyproject.toml"
    declared = pyproject.read_text()
    assert declared.count('    "cryptography>=') == 1
    pyproject.write_text(
        "\n".join(line for line in declared.splitlines() if '"cryptography>=' not in line)
    )
    try:
        status, issues = deptry(checkout, tmp_path)
    finally:
        pyproject.write_text(declared)
    assert status == 1
    assert {(i["error"]["code"], i["module"], i["location"]["file"]) for i in issues} == {
        ("DEP003", "cryptography", "rtrl/signing.py")
    }
