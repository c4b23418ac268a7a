"""The operator docs stay true to the code: the generated reference is current, it
names every setting, what the hand-written guides cite (tests, variables, topics,
links) exists, and every guarantee of ARCHITECTURE.md has tests marked guarantee(n)
that the troubleshooting guide lists. No services; about as fast as importing the
settings classes."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings

from rtrl import topics
from rtrl.ops import docgen

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
GUIDES = ("operations.md", "troubleshooting.md")
# RTRL_* variables that belong to no settings class: compose/ and scripts/ read them
# themselves. Each must still be used where it says (checked below), so the list cannot rot.
NOT_SETTINGS = {
    "RTRL_IMAGE": "compose/compose.yaml",
    "RTRL_SGLANG_IMAGE": "compose/compose.yaml",
    "RTRL_KAFKA_CLUSTER_ID": "compose/compose.yaml",
    "RTRL_SGLANG_HOME": "scripts/sglang_rig.py",
    "RTRL_GRAFANA_ADMIN_PASSWORD": "compose/compose.yaml",
    "RTRL_API_KEY_SIGNING_KEY": "ops/stack_secrets.py",  # the operator's, read by rtrl keys; no service setting
}


def settings_classes() -> list[type[BaseSettings]]:
    """Found without the generator: every ``class X(...Settings...)`` that sets its env
    prefix in the service packages, by parsing the source."""
    classes = []
    packages = [
        d for d in sorted(REPO.iterdir()) if (d / "__init__.py").exists() and d.name != "tests"
    ]
    for path in sorted(path for package in packages for path in package.rglob("*.py")):
        relative = path.relative_to(REPO)
        source = path.read_text(encoding="utf-8")
        if "env_prefix=" not in source:
            continue
        for node in ast.parse(source).body:
            if (
                isinstance(node, ast.ClassDef)
                and any(ast.unparse(base).endswith("Settings") for base in node.bases)
                and "env_prefix=" in ast.unparse(node)
            ):
                module = importlib.import_module(".".join(relative.with_suffix("").parts))
                classes.append(getattr(module, node.name))
    return classes


def expected_env_vars(cls: type[BaseSettings]) -> list[str]:
    names = []
    for name, field in cls.model_fields.items():
        alias = field.validation_alias
        assert alias is None or isinstance(alias, str), (
            f"{cls.__name__}.{name}: extend this test for {alias!r}"
        )
        names.append((alias or cls.model_config.get("env_prefix", "") + name).upper())
    return names


def every_env_var() -> set[str]:
    return {name for cls in settings_classes() for name in expected_env_vars(cls)}


def guide_text(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def generated() -> dict[Path, str]:
    return docgen.render()


@pytest.mark.parametrize("path", [docgen.CONFIGURATION, docgen.TOPICS, docgen.CLI], ids=str)
def test_generated_docs_are_current(generated, path):
    assert (REPO / path).read_text(encoding="utf-8") == generated[path], (
        f"{path} is stale: run `python -m rtrl.ops.docgen`"
    )


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
    cited = [
        (file, name)
        for guide in GUIDES
        for file, name in re.findall(r"tests/([\w/]+\.py)::(\w+)", guide_text(guide))
    ]
    assert len(cited) >= 30, "the troubleshooting guide cites the fault tests"
    missing = []
    for file, name in sorted(set(cited)):
        path = REPO / "tests" / file
        tree = (
            ast.parse(path.read_text(encoding="utf-8"))
            if path.exists()
            else ast.Module(body=[], type_ignores=[])
        )
        defined = {
            node.name
            for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        }
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
        assert name in (REPO / where).read_text(encoding="utf-8"), (
            f"{name} is no longer used in {where}"
        )


def test_the_guide_says_who_produces_and_consumes_every_topic():
    section = (
        guide_text("operations.md").split("## Topics and retention", 1)[1].split("\n## ", 1)[0]
    )
    for topic in topics.ALL:
        assert f"| `{topic}` |" in section, f"operations.md has no row for {topic}"
    for named in re.findall(r"\| `((?:telemetry|rl)\.[\w.<>]+)` \|", section):
        assert named in topics.ALL or named == topics.reward_replay("<version>"), named


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.DOTALL)
    return {
        docgen.anchor(heading.replace("`", ""))
        for heading in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)
    }


def test_relative_links_and_anchors_resolve():
    broken = []
    for path in sorted(DOCS.glob("*.md")) + [REPO / "README.md"]:
        for target, fragment in re.findall(
            r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", path.read_text(encoding="utf-8")
        ):
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


# ---- every guarantee of ARCHITECTURE.md has a test that breaks something to prove it ----

TESTS = REPO / "tests"
GUARANTEES = range(1, 9)
"""ARCHITECTURE.md's guarantees, by number."""
PROOFS_HEADING = "## Which test proves each guarantee"


def guarantee_numbers(node: ast.AST) -> list[int]:
    """The n of every ``pytest.mark.guarantee(n)`` within ``node``."""
    numbers = []
    for call in ast.walk(node):
        if (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr == "guarantee"
        ):
            [argument] = call.args
            assert isinstance(argument, ast.Constant) and type(argument.value) is int, (
                f"{ast.unparse(call)}: n must be a literal int"
            )
            numbers.append(argument.value)
    return numbers


def marked_tests(root: Path) -> dict[int, set[str]]:
    """Node ids (``tests/<dir>/<file>.py::<test>``) by guarantee, read from the source with
    ``ast`` rather than by running pytest: each test function's decorators, and its
    module's ``pytestmark``. A marker anywhere else would go unseen, so it is refused."""
    marked: dict[int, set[str]] = {}
    for path in sorted(root.rglob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        module_wide = [
            n
            for node in tree.body
            if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
            for n in guarantee_numbers(node.value)
        ]
        tests = [
            node
            for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.name.startswith("test")
        ]
        read = len(module_wide)
        for test in tests:
            own = [n for decorator in test.decorator_list for n in guarantee_numbers(decorator)]
            read += len(own)
            for n in module_wide + own:
                marked.setdefault(n, set()).add(
                    f"{path.relative_to(root.parent).as_posix()}::{test.name}"
                )
        assert read == len(guarantee_numbers(tree)), (
            f"{path}: a guarantee marker outside a test's decorators or pytestmark"
        )
    return marked


def guarantee_problems(marked: dict[int, set[str]]) -> list[str]:
    problems = [
        f"guarantee {n}: no test is marked guarantee({n})" for n in GUARANTEES if n not in marked
    ]
    problems += [
        f"guarantee({n}) on {sorted(marked[n])}: ARCHITECTURE.md has guarantees 1..8"
        for n in sorted(set(marked) - set(GUARANTEES))
    ]
    return problems


def listed_proofs() -> dict[int, set[str]]:
    """The node ids troubleshooting.md lists under each guarantee's number."""
    section = (
        guide_text("troubleshooting.md").split(f"\n{PROOFS_HEADING}\n", 1)[1].split("\n## ", 1)[0]
    )
    listed: dict[int, set[str]] = {}
    number = None
    for line in section.splitlines():
        if start := re.match(r"(\d+)\. ", line):
            number = int(start.group(1))
            assert number not in listed, f"guarantee {number} is listed twice"
            listed[number] = set()
        for node_id in re.findall(r"`(tests/[\w/]+\.py::\w+)`", line):
            assert number is not None, f"{node_id} is listed under no guarantee"
            listed[number].add(node_id)
    return listed


def test_every_guarantee_has_a_test_that_breaks_something():
    assert guarantee_problems(marked_tests(TESTS)) == []


def test_the_guide_lists_exactly_the_tests_marked_for_each_guarantee():
    listed, marked = listed_proofs(), marked_tests(TESTS)
    assert sorted(listed) == list(GUARANTEES)
    differences = {
        n: {
            "marked, not listed": sorted(marked.get(n, set()) - listed[n]),
            "listed, not marked": sorted(listed[n] - marked.get(n, set())),
        }
        for n in listed
        if listed[n] != marked.get(n, set())
    }
    assert differences == {}, f"update {PROOFS_HEADING!r} in docs/troubleshooting.md"


def test_the_marker_walker_reads_decorators_and_pytestmark_and_refuses_unknown_guarantees(tmp_path):
    tests = tmp_path / "tests"
    (tests / "trainer").mkdir(parents=True)
    (tests / "trainer" / "test_a.py").write_text(
        "import pytest\n"
        "pytestmark = [pytest.mark.integration, pytest.mark.guarantee(8)]\n"
        "@pytest.mark.guarantee(1)\n@pytest.mark.parametrize('x', [1])\ndef test_one(x): pass\n"
        "def test_two(): pass\n"
    )
    (tests / "trainer" / "test_b.py").write_text(
        "import pytest\n@pytest.mark.guarantee(9)\ndef test_three(): pass\n"
    )
    marked = marked_tests(tests)
    assert marked == {
        8: {"tests/trainer/test_a.py::test_one", "tests/trainer/test_a.py::test_two"},
        1: {"tests/trainer/test_a.py::test_one"},
        9: {"tests/trainer/test_b.py::test_three"},
    }
    assert guarantee_problems(marked) == [
        *(f"guarantee {n}: no test is marked guarantee({n})" for n in range(2, 8)),
        "guarantee(9) on ['tests/trainer/test_b.py::test_three']: ARCHITECTURE.md has guarantees 1..8",
    ]
    (tests / "trainer" / "test_b.py").write_text(
        "import pytest\nclass TestC:\n    @pytest.mark.guarantee(2)\n    def test_four(self): pass\n"
    )
    with pytest.raises(AssertionError, match="outside a test's decorators"):
        marked_tests(tests)
    (tests / "trainer" / "test_b.py").write_text(
        "import pytest\nN = 2\n@pytest.mark.guarantee(N)\ndef test_five(): pass\n"
    )
    with pytest.raises(AssertionError, match="must be a literal int"):
        marked_tests(tests)
