"""The operator docs stay true to the code: the generated reference is current, it
names every setting, what the hand-written docs cite (tests, variables, topics) exists,
and every guarantee of docs/architecture.md has tests marked guarantee(n), listed there
under it. No services; about as fast as importing the settings classes. Links are checked
in test_links.py."""

from __future__ import annotations

import ast
import importlib
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings

from rtrl import topics
from rtrl.ops import docgen

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
GUIDES = (
    "operations.md",
    "troubleshooting.md",
    "architecture.md",
    "security.md",
    "benchmarks.md",
    "your-model.md",
    "agents.md",
    "demo.md",
    "telemetry.md",
)
"""The hand-written docs whose cited tests and variables must exist."""
# RTRL_* variables that belong to no settings class: compose/, scripts/ and examples read them
# themselves. Each must still be used where it says (checked below), so the list cannot rot.
NOT_SETTINGS = {
    "RTRL_IMAGE": "compose/compose.yaml",
    "RTRL_SGLANG_IMAGE": "compose/compose.yaml",
    "RTRL_KAFKA_CLUSTER_ID": "compose/compose.yaml",
    "RTRL_SGLANG_HOME": "scripts/sglang_rig.py",
    "RTRL_GRAFANA_ADMIN_PASSWORD": "compose/compose.yaml",
    "RTRL_API_KEY_SIGNING_KEY": "ops/stack_secrets.py",  # the operator's, read by rtrl keys; no service setting
    "RTRL_INGEST_URL": "clients/python/examples/send_events.py",  # the SDK example's
    "RTRL_API_KEY": "clients/python/examples/send_events.py",
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


# ---- every guarantee of docs/architecture.md has a test that breaks something to prove it ----

TESTS = REPO / "tests"
GUARANTEES_PAGE = DOCS / "architecture.md"
GUARANTEES_HEADING = "## Guarantees"
NO_TEST_YET = "- No test yet:"
"""How a guarantee says it has no test: the check then fails once one is marked, until it
is listed."""


@dataclass(frozen=True)
class Documented:
    """One guarantee as docs/architecture.md states it."""

    proofs: frozenset[str]
    """The node ids listed under it."""
    untested: bool
    """It says it has no test yet."""


def documented_guarantees(text: str) -> dict[int, Documented]:
    """The guarantees the "## Guarantees" section of ``text`` numbers, each with the node ids
    listed under it and whether it says it has no test yet."""
    section = text.split(f"\n{GUARANTEES_HEADING}\n", 1)[1].split("\n## ", 1)[0]
    proofs: dict[int, set[str]] = {}
    untested: set[int] = set()
    number = None
    for line in section.splitlines():
        if start := re.match(r"(\d+)\. ", line):
            number = int(start.group(1))
            assert number not in proofs, f"guarantee {number} is listed twice"
            proofs[number] = set()
        elif line.strip().startswith(NO_TEST_YET):
            assert number is not None, "a guarantee without a test, under no guarantee"
            untested.add(number)
        for node_id in re.findall(r"`(tests/[\w/]+\.py::\w+)`", line):
            assert number is not None, f"{node_id} is listed under no guarantee"
            proofs[number].add(node_id)
    return {n: Documented(frozenset(ids), n in untested) for n, ids in proofs.items()}


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


def guarantee_problems(marked: dict[int, set[str]], documented: dict[int, Documented]) -> list[str]:
    """What differs between the markers and the page: a guarantee without a test that does
    not say so, a test marked but not listed or listed but not marked, a number that is no
    guarantee, and a guarantee that says it has no test while one is marked."""
    count = len(documented)
    problems = []
    if sorted(documented) != list(range(1, count + 1)):
        problems.append(f"the guarantees are numbered {sorted(documented)}, not 1..{count}")
    for n, doc in sorted(documented.items()):
        tests = marked.get(n, set())
        if doc.untested and tests:
            problems.append(
                f"guarantee {n} says it has no test yet, but {sorted(tests)} are marked"
            )
        elif not doc.untested and not tests:
            problems.append(f"guarantee {n}: no test is marked guarantee({n})")
        if not doc.untested:
            problems += [
                f"guarantee {n}: {t} is marked, not listed" for t in sorted(tests - doc.proofs)
            ]
        problems += [
            f"guarantee {n}: {t} is listed, not marked" for t in sorted(doc.proofs - tests)
        ]
    problems += [
        f"guarantee({n}) on {sorted(marked[n])}: docs/architecture.md has guarantees 1..{count}"
        for n in sorted(set(marked) - set(documented))
    ]
    return problems


def test_the_architecture_states_ten_guarantees():
    assert sorted(documented_guarantees(GUARANTEES_PAGE.read_text(encoding="utf-8"))) == list(
        range(1, 11)
    )


def test_every_guarantee_has_tests_that_break_something_and_the_page_lists_exactly_them():
    documented = documented_guarantees(GUARANTEES_PAGE.read_text(encoding="utf-8"))
    assert guarantee_problems(marked_tests(TESTS), documented) == [], (
        f"update {GUARANTEES_HEADING!r} in docs/architecture.md"
    )


def test_the_marker_walker_reads_decorators_and_pytestmark_and_refuses_hidden_markers(tmp_path):
    tests = tmp_path / "tests"
    (tests / "trainer").mkdir(parents=True)
    (tests / "trainer" / "test_a.py").write_text(
        "import pytest\n"
        "pytestmark = [pytest.mark.integration, pytest.mark.guarantee(8)]\n"
        "@pytest.mark.guarantee(1)\n@pytest.mark.parametrize('x', [1])\ndef test_one(x): pass\n"
        "def test_two(): pass\n"
    )
    (tests / "trainer" / "test_b.py").write_text(
        "import pytest\n@pytest.mark.guarantee(11)\ndef test_three(): pass\n"
    )
    assert marked_tests(tests) == {
        8: {"tests/trainer/test_a.py::test_one", "tests/trainer/test_a.py::test_two"},
        1: {"tests/trainer/test_a.py::test_one"},
        11: {"tests/trainer/test_b.py::test_three"},
    }
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


PLANTED_PAGE = """# Architecture

## Guarantees

Each guarantee lists its tests.

1. Events are counted once.
   - `tests/trainer/test_a.py::test_one` (a kill)
   - `tests/trainer/test_a.py::test_gone` (a test deleted since)
2. A bad event stops nothing.
3. Nothing is lost on restart.
   - No test yet: not built.
4. Erased users leave nothing.
   - No test yet: being written.

## Two ways to run the same code

5. Not a guarantee: another section.
"""


def test_the_page_and_the_markers_are_compared_both_ways():
    documented = documented_guarantees(PLANTED_PAGE)
    assert sorted(documented) == [1, 2, 3, 4]
    assert documented[3] == Documented(proofs=frozenset(), untested=True)
    marked = {
        1: {"tests/trainer/test_a.py::test_one", "tests/trainer/test_a.py::test_two"},
        4: {"tests/trainer/test_b.py::test_three"},
        5: {"tests/trainer/test_b.py::test_four"},
    }
    assert guarantee_problems(marked, documented) == [
        "guarantee 1: tests/trainer/test_a.py::test_two is marked, not listed",
        "guarantee 1: tests/trainer/test_a.py::test_gone is listed, not marked",
        "guarantee 2: no test is marked guarantee(2)",
        "guarantee 4 says it has no test yet, but ['tests/trainer/test_b.py::test_three'] are marked",
        "guarantee(5) on ['tests/trainer/test_b.py::test_four']: docs/architecture.md has guarantees 1..4",
    ]
    gap = {**documented, 6: Documented(proofs=frozenset(), untested=True)}
    assert guarantee_problems({}, gap)[0] == "the guarantees are numbered [1, 2, 3, 4, 6], not 1..5"
    with pytest.raises(AssertionError, match="listed twice"):
        documented_guarantees(PLANTED_PAGE.replace("2. A bad", "1. A bad"))
