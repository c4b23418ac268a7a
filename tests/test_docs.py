"""The operator docs stay true to the code: the generated reference is current, it
names every setting, and what the hand-written guides cite (tests, variables, topics,
links) exists. No services; about as fast as importing the settings classes."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from rtrl import docgen, topics

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
GUIDES = ("operations.md", "troubleshooting.md")
# RTRL_* variables that belong to no settings class: compose/ and scripts/ read them
# themselves. Each must still be used where it says (checked below), so the list cannot rot.
NOT_SETTINGS = {
    "RTRL_IMAGE": "compose/compose.yaml",
    "RTRL_SGLANG_IMAGE": "compose/compose.yaml",
    "RTRL_KAFKA_CLUSTER_ID": "compose/compose.yaml",
    "RTRL_SGLANG_HOME": "scripts/sglang_rig.py",
    "RTRL_API_KEY_SIGNING_KEY": "rtrl/stack_secrets.py",  # the operator's, read by rtrl keys; no service setting
}


def settings_classes() -> list[type]:
    """Found without the generator: every ``class X(...BaseSettings...)`` in the service
    packages, by parsing the source."""
    classes = []
    packages = [d for d in sorted(REPO.iterdir()) if (d / "__init__.py").exists() and d.name != "tests"]
    for path in sorted(path for package in packages for path in package.rglob("*.py")):
        relative = path.relative_to(REPO)
        source = path.read_text(encoding="utf-8")
        if "BaseSettings" not in source:
            continue
        for node in ast.parse(source).body:
            if isinstance(node, ast.ClassDef) and any(ast.unparse(base).endswith("BaseSettings") for base in node.bases):
                module = importlib.import_module(".".join(relative.with_suffix("").parts))
                classes.append(getattr(module, node.name))
    return classes


def expected_env_vars(cls: type) -> list[str]:
    names = []
    for name, field in cls.model_fields.items():
        alias = field.validation_alias
        assert alias is None or isinstance(alias, str), f"{cls.__name__}.{name}: extend this test for {alias!r}"
        names.append((alias or cls.model_config.get("env_prefix", "") + name).upper())
    return names


def every_env_var() -> set[str]:
    return {name for cls in settings_classes() for name in expected_env_vars(cls)}


def guide_text(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def generated() -> dict[Path, str]:
    return docgen.render()


@pytest.mark.parametrize("path", [docgen.CONFIGURATION, docgen.TOPICS], ids=str)
def test_generated_docs_are_current(generated, path):
    assert (REPO / path).read_text(encoding="utf-8") == generated[path], f"{path} is stale: run `python -m rtrl.docgen`"


def test_the_reference_names_every_setting_of_every_class():
    classes = settings_classes()
    assert len(classes) >= 10, [c.__name__ for c in classes]
    reference = (REPO / docgen.CONFIGURATION).read_text(encoding="utf-8")
    missing = [
        f"{cls.__module__}.{cls.__name__}: {name}"
        for cls in classes
        for name in expected_env_vars(cls)
        if f"| `{name}`" not in reference and f"<br>`{name}`" not in reference
    ]
    assert not missing, missing
    for cls in classes:
        assert f"`{cls.__module__}.{cls.__name__}`" in reference


def test_every_cited_test_exists():
    cited = [(file, name) for guide in GUIDES for file, name in re.findall(r"tests/([\w/]+\.py)::(\w+)", guide_text(guide))]
    assert len(cited) >= 30, "the troubleshooting guide cites the fault tests"
    missing = []
    for file, name in sorted(set(cited)):
        path = REPO / "tests" / file
        tree = ast.parse(path.read_text(encoding="utf-8")) if path.exists() else ast.Module(body=[], type_ignores=[])
        defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
        if name not in defined:
            missing.append(f"tests/{file}::{name}")
    assert not missing, missing


def test_every_variable_in_the_guides_exists():
    known = every_env_var()
    unknown = []
    for guide in GUIDES:
        for name in sorted(set(re.findall(r"\bRTRL_[A-Z0-9_]+", guide_text(guide)))):
            if name.endswith("_"):  # a family: RTRL_INGEST_, RTRL_WEIGHT_SYNC_S3_
                if not any(variable.startswith(name) for variable in known):
                    unknown.append(f"{guide}: {name}*")
            elif name not in known and name not in NOT_SETTINGS:
                unknown.append(f"{guide}: {name}")
    assert not unknown, unknown
    for name, where in NOT_SETTINGS.items():
        assert name in (REPO / where).read_text(encoding="utf-8"), f"{name} is no longer used in {where}"


def test_the_guide_says_who_produces_and_consumes_every_topic():
    section = guide_text("operations.md").split("## Topics and retention", 1)[1].split("\n## ", 1)[0]
    for topic in topics.ALL:
        assert f"| `{topic}` |" in section, f"operations.md has no row for {topic}"
    for named in re.findall(r"\| `((?:telemetry|rl)\.[\w.<>]+)` \|", section):
        assert named in topics.ALL or named == topics.reward_replay("<version>"), named


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.DOTALL)
    return {docgen.anchor(heading.replace("`", "")) for heading in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)}


def test_relative_links_and_anchors_resolve():
    broken = []
    for path in sorted(DOCS.glob("*.md")) + [REPO / "README.md"]:
        for target, fragment in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", path.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            resolved = (path.parent / target).resolve() if target else path
            # Links out of the repository (README's ../shared/) are not the docs' to keep.
            if not resolved.is_relative_to(REPO):
                continue
            if not resolved.exists():
                broken.append(f"{path.relative_to(REPO)} -> {target}")
            elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
                broken.append(f"{path.relative_to(REPO)} -> {target}#{fragment}")
    assert not broken, broken
