"""The habits are enforced the same way everywhere: CI, pre-commit and the README name the
same make targets, and those targets run the pinned tools with pyproject.toml's config."""

import re
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
HABITS = ("lint", "typecheck", "proto-check")


def make_calls(script: str) -> list[str]:
    return re.findall(r"^make ([\w-]+)$", script, flags=re.M)


def test_ci_runs_every_habit_before_the_tests():
    calls = make_calls((REPO / ".ci" / "run").read_text())
    assert calls[0] == "install" and "test" in calls
    assert all(habit in calls[: calls.index("test")] for habit in HABITS), calls


def test_pre_commit_runs_the_same_targets_and_its_config_is_valid():
    config = REPO / ".pre-commit-config.yaml"
    checked = subprocess.run(
        [Path(sys.executable).parent / "pre-commit", "validate-config", str(config)],
        capture_output=True,
        text=True,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    hooks = [hook for repo in yaml.safe_load(config.read_text())["repos"] for hook in repo["hooks"]]
    assert sorted(hook["entry"] for hook in hooks) == sorted(f"make {habit}" for habit in HABITS)


def test_the_targets_run_the_pinned_tools_with_the_projects_config():
    makefile = (REPO / "Makefile").read_text()
    targets = dict(re.findall(r"^([\w-]+):[^\n]*\n((?:\t[^\n]*\n)+)", makefile, flags=re.M))
    assert "ruff check ." in targets["lint"] and "ruff format --check ." in targets["lint"]
    assert "mypy" in targets["typecheck"]
    pyproject = (REPO / "pyproject.toml").read_text()
    # Pinned names as pip spells them (pip freeze writes pre_commit): compared normalised.
    pins = [
        re.sub(r"[-_.]+", "-", line).lower()
        for line in (REPO / "constraints.txt").read_text().splitlines()
    ]
    for tool in ("ruff", "mypy", "pre-commit", "deptry"):
        # Declared by the dev extra as a range, pinned where CI installs it (constraints.txt).
        assert f'"{tool}>=' in pyproject, tool
        assert any(line.startswith(f"{tool}==") for line in pins), tool
    assert "deptry ." in targets["lint"]
    assert (
        "[tool.ruff]" in pyproject
        and "[tool.mypy]" in pyproject
        and "check_untyped_defs = true" in pyproject
    )


def test_the_readme_names_the_habits():
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Development", 1)[1].split("\n## ", 1)[0]
    for habit in ("make lint", "make typecheck", "make format", "pre-commit install"):
        assert habit in section, habit
