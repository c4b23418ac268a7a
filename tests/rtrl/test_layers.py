"""The layers of docs/architecture.md hold: every import points down, inside one namespace.

0. the client: ``rtrl_client`` (clients/python), its own distribution, which products
   install without the server: it imports nothing of ``rtrl``;
1. foundation: ``rtrl`` (its own modules: config, topics, trajectory...);
2. services: rtrl.ingest, .reward_stream, .trainer, .inference, .weight_sync, .analytics,
   and .kernels (their hot loops); a service reaches another only through that service's
   public client modules (PUBLIC);
3. the operator's shell: ``rtrl.ops`` (and ``python -m rtrl``, its CLI), the simulated
   product, the benches.

What is installed is one package, ``rtrl``: the repository's top-level folders (trainer/,
ops/...) are reached through symlinks in rtrl/ (rtrl/trainer -> ../trainer). A module
that imports one of them by its folder name (``import trainer``) works only from a
checkout, and takes a name another PyPI project owns: that is an edge too.

Every ``import`` statement counts, including those inside functions and under
TYPE_CHECKING: a lazy import is still a dependency. So does a plug-in string
(``"module.path:callable"``, loaded by rtrl.plugins at start-up): a service whose default
names the shell depends on it as surely as an import.
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CLIENT, FOUNDATION, SERVICE, SHELL = 0, 1, 2, 3
CLIENT_SRC = Path("clients/python/src")
"""Where the client distribution keeps ``rtrl_client``."""
FOLDERS = {
    "ingest": SERVICE,
    "reward_stream": SERVICE,
    "trainer": SERVICE,
    "inference": SERVICE,
    "weight_sync": SERVICE,
    "analytics": SERVICE,
    "kernels": SERVICE,
    "ops": SHELL,
    "simulator": SHELL,
    "bench": SHELL,
}
"""The repository's top-level packages besides rtrl/, each installed as rtrl.<folder>."""
PACKAGES = {
    "rtrl_client": CLIENT,
    "rtrl": FOUNDATION,
    "rtrl.__main__": SHELL,
    **{f"rtrl.{folder}": layer for folder, layer in FOLDERS.items()},
}
LIBRARIES = {"rtrl.kernels"}
"""Service-layer packages any service may use whole."""
PUBLIC = {"rtrl.weight_sync.client", "rtrl.weight_sync.provenance"}
"""A service's modules other services may import: weight_sync's subscriber and publisher."""
PLUGIN = re.compile(r"[A-Za-z_]\w*(?:\.\w+)+:[A-Za-z_]\w*")
"""A plug-in string, ``package.module:attribute`` (rtrl/plugins.py)."""


@dataclass(frozen=True)
class Edge:
    module: str
    imported: str
    line: int
    how: str = "imports"

    def __str__(self) -> str:
        return f"{self.module}:{self.line} {self.how} {self.imported}"


def package_of(module: str) -> str | None:
    """The longest entry of PACKAGES that is ``module`` or contains it."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in PACKAGES:
            return ".".join(parts[:n])
    return None


def imports(path: Path, module: str) -> list[tuple[str, int, str]]:
    """Absolute module names ``path`` imports or names in a plug-in string, with the line
    and how ("imports" or "names plug-in")."""
    found = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, "imports") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # "from rtrl import ops" imports rtrl.ops: judge each name as a module too.
            found += [(f"{base}.{alias.name}", node.lineno, "imports") for alias in node.names]
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and PLUGIN.fullmatch(node.value)
        ):
            found.append((node.value.partition(":")[0], node.lineno, "names plug-in"))
    return found


def modules(root: Path) -> dict[str, Path]:
    """Every module of the namespace by its installed name, read through rtrl/'s symlinks,
    and of the client distribution."""
    found: dict[str, Path] = {}
    for base, top in ((root, "rtrl"), (root / CLIENT_SRC, "rtrl_client")):
        found |= _modules_under(base, top)
    return found


def _modules_under(base: Path, top: str) -> dict[str, Path]:
    found = {}
    for directory, _, files in os.walk(base / top, followlinks=True):
        for name in sorted(f for f in files if f.endswith(".py")):
            path = Path(directory) / name
            relative = path.relative_to(base).with_suffix("")
            parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
            found[".".join(parts)] = path
    return found


def forbidden_edges(root: Path) -> list[Edge]:
    edges = []
    for module, path in modules(root).items():
        source = package_of(module)
        for imported, line, how in imports(path, module):
            if imported.split(".")[0] in FOLDERS:
                edges.append(Edge(module, imported, line, how + " outside rtrl:"))
                continue
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
                edges.append(Edge(module, imported, line, how))
    return edges


def test_every_import_points_down_the_layers():
    assert [str(edge) for edge in forbidden_edges(REPO)] == []


def test_every_package_is_in_a_layer_and_installed_under_rtrl():
    tops = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"rtrl"}
    assert tops - set(FOLDERS) == set()
    for folder in FOLDERS:
        link = REPO / "rtrl" / folder
        assert link.is_symlink() and os.readlink(link) == f"../{folder}", link


PLANTED = {
    # (module planted, its source): the edge expected, or None when it is allowed.
    "foundation importing the shell": (
        "rtrl/planted.py",
        "from rtrl.ops import cli\n",
        "rtrl.ops.cli",
    ),
    "foundation importing a service lazily": (
        "rtrl/planted.py",
        "def f():\n    from rtrl.trainer.loop import Trainer\n",
        "rtrl.trainer.loop.Trainer",
    ),
    "service importing the shell": (
        "trainer/planted.py",
        "import rtrl.simulator.tasks\n",
        "rtrl.simulator.tasks",
    ),
    "foundation importing the shell relatively": (
        "rtrl/planted.py",
        "from .ops import demo\n",
        "rtrl.ops.demo",
    ),
    "service importing another's internals": (
        "inference/planted.py",
        "from rtrl.weight_sync.registry import Registry\n",
        "rtrl.weight_sync.registry.Registry",
    ),
    "service importing another's internals relatively": (
        "inference/planted.py",
        "from ..weight_sync import registry\n",
        "rtrl.weight_sync.registry",
    ),
    "service naming the shell in a plug-in default": (
        "trainer/planted.py",
        'class Settings:\n    eval_suite: str = "rtrl.simulator.suite:demo_suite"\n',
        "rtrl.simulator.suite",
    ),
    "foundation naming a service in a plug-in string": (
        "rtrl/planted.py",
        'DEFAULT = "rtrl.trainer.baseline:global_key"\n',
        "rtrl.trainer.baseline",
    ),
    "service importing a folder by its bare name": (
        "ingest/planted.py",
        "from kernels import delta\n",
        "kernels.delta",
    ),
    "shell naming a plug-in by its bare folder name": (
        "ops/planted.py",
        'SUITE = "simulator.suite:demo_suite"\n',
        "simulator.suite",
    ),
    "service using another's client": (
        "inference/planted.py",
        "from rtrl.weight_sync.client import Subscriber\n",
        None,
    ),
    "the client importing the foundation": (
        "clients/python/src/rtrl_client/planted.py",
        "from rtrl import topics\n",
        "rtrl.topics",
    ),
    "the client importing a service lazily": (
        "clients/python/src/rtrl_client/planted.py",
        "def f():\n    import rtrl.ingest.gateway\n",
        "rtrl.ingest.gateway",
    ),
    "a service using the client": (
        "ingest/planted.py",
        "from rtrl_client.v1 import telemetry_pb2\n",
        None,
    ),
    "service using kernels": ("weight_sync/planted.py", "from rtrl.kernels import delta\n", None),
    "service naming its own plug-in": (
        "trainer/planted.py",
        'KEY = "rtrl.trainer.baseline:no_context"\n',
        None,
    ),
    "shell importing and naming everything": (
        "bench/planted.py",
        'import rtrl.trainer.loop\nfrom rtrl.ops import cli\nS = "rtrl.simulator.suite:demo_suite"\n',
        None,
    ),
    "a redis key is no plug-in": ("trainer/planted.py", 'KEY = "rtrl:hb:trainer"\n', None),
}


def test_a_planted_upward_import_or_plugin_string_is_caught(tmp_path):
    for case, (planted, source, expected) in PLANTED.items():
        root = tmp_path / case.replace(" ", "_")
        (root / "rtrl").mkdir(parents=True)
        (root / "rtrl" / "__init__.py").write_text("")
        for folder in FOLDERS:
            (root / folder).mkdir()
            (root / folder / "__init__.py").write_text("")
            (root / "rtrl" / folder).symlink_to(f"../{folder}")
        (root / CLIENT_SRC / "rtrl_client").mkdir(parents=True)
        (root / CLIENT_SRC / "rtrl_client" / "__init__.py").write_text("")
        (root / planted).write_text(source)
        found = [edge.imported for edge in forbidden_edges(root)]
        assert found == ([expected] if expected else []), case
