"""The test tree a newcomer can navigate: tests/ mirrors the packages (one directory per
package, whole-stack tests in e2e/, shared helpers in support/), and no test module
imports another: what tests share is a fixture in a conftest.py or a plain function in
support/.

Test modules are imported by pytest's default "prepend" mode: each is a top-level module
named after its file, with its directory put on sys.path. Hence unique basenames, and no
``__init__.py`` but support's."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
NOT_PACKAGES = {
    "e2e": None,  # whole-stack tests, across every service
    "support": None,  # helpers shared across directories
    "clients": None,  # the client distributions of clients/ (rtrl_client, the TypeScript SDK)
}


def python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def is_test_module(dotted: str) -> bool:
    return any(part.startswith("test_") or part == "conftest" for part in dotted.split("."))


def imports_of_test_modules(root: Path) -> list[str]:
    """Every import, anywhere under ``root`` (in functions too), of a test module or a conftest."""
    found = []
    for path in python_files(root):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                # "from a import b" may import the module a.b: judge each name as a module too.
                module = "." * node.level + (node.module or "")
                names = [module] + [
                    f"{module}.{alias.name}" if node.module else module + alias.name
                    for alias in node.names
                ]
            else:
                continue
            offending = next((name for name in names if is_test_module(name)), None)
            if offending:
                found.append((str(path.relative_to(root)), node.lineno, offending))
    return [f"{path}:{line} imports {name}" for path, line, name in sorted(found)]


def test_no_test_module_imports_another():
    assert imports_of_test_modules(TESTS) == []


def test_a_planted_import_of_a_test_module_is_caught(tmp_path):
    (tmp_path / "ingest").mkdir()
    (tmp_path / "support").mkdir()
    (tmp_path / "ingest" / "test_a.py").write_text(
        "from support.ingest import shown\n"
        "from test_b import helper\n"
        "def test_x():\n    import test_c\n"
        "from conftest import fixture\n"
        "from . import test_d\n"
    )
    (tmp_path / "support" / "ingest.py").write_text("import os\nfrom hypothesis import given\n")
    assert imports_of_test_modules(tmp_path) == [
        "ingest/test_a.py:2 imports test_b",
        "ingest/test_a.py:4 imports test_c",
        "ingest/test_a.py:5 imports conftest",
        "ingest/test_a.py:6 imports .test_d",
    ]


def test_every_test_module_sits_in_the_directory_of_a_package():
    assert sorted(p.name for p in TESTS.glob("test_*.py")) == [], (
        "tests/ holds directories, not test modules"
    )
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")}
    directories = {
        p.name
        for p in TESTS.iterdir()
        if p.is_dir() and p.name != "__pycache__" and not p.name.startswith(".")
    }
    assert sorted(directories - packages - set(NOT_PACKAGES)) == []
    assert all(where is None or (where / "__init__.py").exists() for where in NOT_PACKAGES.values())


def test_basenames_are_unique_and_only_support_is_a_package():
    modules = [p for p in python_files(TESTS) if p.name not in ("conftest.py", "__init__.py")]
    seen: dict[str, list[str]] = {}
    for path in modules:
        if path.parent.name != "support":
            seen.setdefault(path.stem, []).append(str(path.relative_to(TESTS)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
    assert [str(p.relative_to(TESTS)) for p in TESTS.rglob("__init__.py")] == [
        "support/__init__.py"
    ]


def test_support_is_importable_and_no_test_directory_shadows_its_package():
    support = importlib.import_module("support")
    assert support.__file__ is not None
    assert Path(support.__file__).parent == TESTS / "support"
    # tests/ingest/ and the like could pass for namespace packages named like the real ones.
    for directory in sorted(p for p in TESTS.iterdir() if (REPO / p.name / "__init__.py").exists()):
        # Installed as one namespace: tests/trainer/ holds the tests of rtrl.trainer.
        name = "rtrl" if directory.name == "rtrl" else f"rtrl.{directory.name}"
        package = importlib.import_module(name)
        assert package.__file__ is not None, package
        assert Path(package.__file__).resolve() == REPO / directory.name / "__init__.py", package
