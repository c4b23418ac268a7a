"""The layers of ARCHITECTURE.md hold: every import points down.

1. foundation: ``rtrl`` (but ``rtrl.ops``);
2. services: ingest, reward_stream, trainer, inference, weight_sync, analytics, and
   kernels (their hot loops); a service reaches another only through that service's
   public client modules (PUBLIC);
3. the operator's shell: ``rtrl.ops`` (and ``python -m rtrl``, its CLI), the
   simulated product, ``bench``.

Every ``import`` statement counts, including those inside functions and under
TYPE_CHECKING: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

FOUNDATION, SERVICE, SHELL = 1, 2, 3
PACKAGES = {
    "rtrl": FOUNDATION,
    "ingest": SERVICE,
    "reward_stream": SERVICE,
    "trainer": SERVICE,
    "inference": SERVICE,
    "weight_sync": SERVICE,
    "analytics": SERVICE,
    "kernels": SERVICE,
    "rtrl.ops": SHELL,
    "rtrl.__main__": SHELL,
    "simulator": SHELL,
    "bench": SHELL,
}
LIBRARIES = {"kernels"}
"""Service-layer packages any service may use whole."""
PUBLIC = {"weight_sync.client", "weight_sync.provenance"}
"""A service's modules other services may import: weight_sync's subscriber and publisher."""


@dataclass(frozen=True)
class Edge:
    module: str
    imported: str
    line: int

    def __str__(self) -> str:
        return f"{self.module}:{self.line} imports {self.imported}"


def package_of(module: str) -> str | None:
    """The longest entry of PACKAGES that is ``module`` or contains it."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in PACKAGES:
            return ".".join(parts[:n])
    return None


def imports(path: Path, module: str) -> list[tuple[str, int]]:
    """Absolute module names ``path`` imports, each with its line."""
    found = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # "from rtrl import ops" imports rtrl.ops: judge each name as a module too.
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return found


def modules(root: Path) -> dict[str, Path]:
    found = {}
    for top in {name.split(".")[0] for name in PACKAGES}:
        for path in sorted((root / top).rglob("*.py")):
            relative = path.relative_to(root).with_suffix("")
            parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
            found[".".join(parts)] = path
    return found


def forbidden_edges(root: Path) -> list[Edge]:
    edges = []
    for module, path in modules(root).items():
        source = package_of(module)
        for imported, line in imports(path, module):
            target = package_of(imported)
            if source is None or target is None or target == source:
                continue
            upward = PACKAGES[target] > PACKAGES[source]
            sideways = (
                PACKAGES[source] == PACKAGES[target] == SERVICE
                and target not in LIBRARIES
                and not any(imported == p or imported.startswith(p + ".") for p in PUBLIC)
            )
            if upward or sideways:
                edges.append(Edge(module, imported, line))
    return edges


def test_every_import_points_down_the_layers():
    assert [str(edge) for edge in forbidden_edges(REPO)] == []


def test_every_package_is_in_a_layer():
    tops = {p.parent.name for p in REPO.glob("*/__init__.py")}
    assert tops - {name.split(".")[0] for name in PACKAGES} == set()


PLANTED = {
    # (module planted, its source): the edge expected, or None when it is allowed.
    "foundation importing the shell": (
        "rtrl/planted.py",
        "from rtrl.ops import cli\n",
        "rtrl.ops.cli",
    ),
    "foundation importing a service lazily": (
        "rtrl/planted.py",
        "def f():\n    from trainer.loop import Trainer\n",
        "trainer.loop.Trainer",
    ),
    "service importing the shell": (
        "trainer/planted.py",
        "import simulator.tasks\n",
        "simulator.tasks",
    ),
    "foundation importing the shell relatively": (
        "rtrl/planted.py",
        "from .ops import demo\n",
        "rtrl.ops.demo",
    ),
    "service importing another's internals": (
        "inference/planted.py",
        "from weight_sync.registry import Registry\n",
        "weight_sync.registry.Registry",
    ),
    "service using another's client": (
        "inference/planted.py",
        "from weight_sync.client import Subscriber\n",
        None,
    ),
    "service using kernels": ("weight_sync/planted.py", "from kernels import delta\n", None),
    "shell importing everything": (
        "bench/planted.py",
        "import trainer.loop\nfrom rtrl.ops import cli\n",
        None,
    ),
}


def test_a_planted_upward_import_is_caught(tmp_path):
    for case, (planted, source, expected) in PLANTED.items():
        root = tmp_path / case.replace(" ", "_")
        for top in {name.split(".")[0] for name in PACKAGES}:
            (root / top).mkdir(parents=True)
            (root / top / "__init__.py").write_text("")
        (root / "rtrl" / "ops").mkdir()
        (root / "rtrl" / "ops" / "__init__.py").write_text("")
        (root / planted).write_text(source)
        found = [edge.imported for edge in forbidden_edges(root)]
        assert found == ([expected] if expected else []), case
