"""@rtrl/client as a Node project installs it: ``npm pack`` of clients/typescript, installed
into a scratch project outside the checkout, imported by an ES module, required by a
CommonJS module (Node 20 cannot require() an ES module: the package ships a CommonJS build
under the ``require`` condition), and type-checked by tsc for both, where a call with a
wrong type must fail to compile."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "clients" / "typescript"
TSC = PACKAGE / "node_modules" / ".bin" / "tsc"
SHIPPED = {
    "package.json", "README.md", "LICENSE",
    "dist/node.js", "dist/node.d.ts", "dist/browser.js", "dist/browser.d.ts",
    "dist/cjs/node.js", "dist/cjs/node.d.ts", "dist/cjs/browser.js", "dist/cjs/browser.d.ts",
    "dist/cjs/package.json", "dist/rtrl-client.browser.js",
}  # fmt: skip
"""Files the tarball must hold: both builds of both entries, their types, the license."""

USE = """{ rolloutId: "r", sessionId: "s", userId: "u", filePath: "a.ts", editText: "x = 1" }"""
ESM_CONSUMER = f"""
import {{ IngestClient, Spool, Telemetry, VERSION, editShown, encodeEvent }} from "@rtrl/client";
const event = editShown({USE});
console.log(JSON.stringify({{ version: VERSION, bytes: encodeEvent(event).length,
  api: [typeof IngestClient, typeof Spool, typeof Telemetry] }}));
"""
CJS_CONSUMER = f"""
const {{ IngestClient, Spool, Telemetry, VERSION, editShown, encodeEvent }} = require("@rtrl/client");
const event = editShown({USE});
console.log(JSON.stringify({{ version: VERSION, bytes: encodeEvent(event).length,
  api: [typeof IngestClient, typeof Spool, typeof Telemetry],
  resolved: require.resolve("@rtrl/client") }}));
"""
TYPED_ESM = f"""
import {{ IngestClient, Status, editShown, type EventResult, type TelemetryEvent }} from "@rtrl/client";
const event: TelemetryEvent = editShown({USE});
const client = new IngestClient("http://127.0.0.1:8081", {{ apiKey: "k", maxAttempts: 3 }});
export const results: Promise<EventResult[]> = client.publish([event]);
export const accepted: boolean = Status.ACCEPTED === 1;
"""
TYPED_CJS = """
import sdk = require("@rtrl/client");
const event: sdk.TelemetryEvent = sdk.followup(
  { rolloutId: "r", sessionId: "s", userId: "u", secondsAfterEdit: 5, message: "m" });
const version: string = sdk.VERSION;
export = { event, version };
"""
# Planted: a number where the API takes a string, and an option it does not have.
WRONG_ESM = """
import { IngestClient, editShown } from "@rtrl/client";
editShown({ rolloutId: 42, sessionId: "s", userId: "u", filePath: "a.ts", editText: "x" });
new IngestClient("http://127.0.0.1:8081", { retries: 3 });
"""
WRONG_CJS = """
import sdk = require("@rtrl/client");
sdk.followup({ rolloutId: "r", sessionId: "s", userId: "u", secondsAfterEdit: "5", message: "m" });
"""


def run(*args: str | Path, cwd: Path, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout_s
    )


@pytest.fixture(scope="module")
def tarball(tmp_path_factory) -> tuple[Path, set[str]]:
    """The package as `npm pack` makes it from a fresh build, and the files it holds."""
    npm = shutil.which("npm")
    assert npm is not None, "npm is not on PATH: install Node 20 (clients/typescript/README.md)"
    assert TSC.exists(), "clients/typescript has no node_modules: make install-node"
    built = run(npm, "run", "build", cwd=PACKAGE)
    assert built.returncode == 0, built.stdout + built.stderr
    out = tmp_path_factory.mktemp("pack")
    packed = run(npm, "pack", "--json", "--pack-destination", out, cwd=PACKAGE)
    assert packed.returncode == 0, packed.stderr
    (listing,) = json.loads(packed.stdout)
    return out / listing["filename"], {entry["path"] for entry in listing["files"]}


@pytest.fixture(scope="module")
def scratch(tarball, tmp_path_factory) -> Path:
    """A project outside the checkout with only the tarball installed (and its dependency,
    from npm's cache when it has it)."""
    project = tmp_path_factory.mktemp("consumer")
    assert not project.resolve().is_relative_to(PACKAGE.parents[1])
    (project / "package.json").write_text(json.dumps({"name": "consumer", "private": True}))
    installed = run(
        "npm", "install", "--prefer-offline", "--no-audit", "--no-fund", tarball[0], cwd=project
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return project


def test_the_tarball_ships_both_builds_and_their_types_and_no_sources_or_tests(tarball):
    _, files = tarball
    assert SHIPPED <= files, sorted(SHIPPED - files)
    unexpected = sorted(f for f in files if f not in {"package.json", "README.md", "LICENSE"})
    assert all(f.startswith("dist/") for f in unexpected), unexpected
    assert not [f for f in files if ".test." in f or f.endswith(".ts") and not f.endswith(".d.ts")]


def test_the_installed_package_is_published_as_apache_2(scratch):
    manifest = json.loads((scratch / "node_modules/@rtrl/client/package.json").read_text())
    assert manifest["license"] == "Apache-2.0" and "private" not in manifest


@pytest.mark.parametrize(
    ("name", "source", "build"),
    [("consumer.mjs", ESM_CONSUMER, "dist/node.js"), ("consumer.cjs", CJS_CONSUMER, "dist/cjs/")],
    ids=["import", "require"],
)
def test_an_es_module_imports_and_a_commonjs_module_requires_the_node_build(
    scratch, name, source, build
):
    (scratch / name).write_text(source)
    ran = run("node", name, cwd=scratch)
    assert ran.returncode == 0, ran.stderr
    got = json.loads(ran.stdout)
    package = json.loads((PACKAGE / "package.json").read_text())
    assert got["version"] == package["version"] and got["bytes"] > 0
    assert got["api"] == ["function"] * 3  # Spool: the Node entry, not the browser one
    if "resolved" in got:
        assert got["resolved"].endswith("node_modules/@rtrl/client/dist/cjs/node.js")


def tsc(scratch: Path, *files: str) -> subprocess.CompletedProcess[str]:
    """tsc as a TypeScript project on Node resolves packages: the import and require
    conditions of package.json's exports, by file (.mts/.cts)."""
    flags = ["--noEmit", "--strict", "--module", "node16", "--moduleResolution", "node16"]
    return run(TSC, *flags, "--listFiles", *files, cwd=scratch)


def test_types_resolve_for_import_and_require_and_a_wrong_call_fails_to_compile(scratch):
    sources = {
        "typed.mts": TYPED_ESM,
        "typed.cts": TYPED_CJS,
        "wrong.mts": WRONG_ESM,
        "wrong.cts": WRONG_CJS,
    }
    for name, source in sources.items():
        (scratch / name).write_text(source)
    typed = tsc(scratch, "typed.mts", "typed.cts")
    assert typed.returncode == 0, typed.stdout
    read = typed.stdout.splitlines()
    assert any(f.endswith("@rtrl/client/dist/node.d.ts") for f in read)  # import
    assert any(f.endswith("@rtrl/client/dist/cjs/node.d.ts") for f in read)  # require

    wrong = tsc(scratch, "wrong.mts", "wrong.cts")
    errors = sorted(re.findall(r"^(wrong\.[cm]ts)\((\d+),\d+\): error (TS\d+)", wrong.stdout, re.M))
    assert wrong.returncode != 0, wrong.stdout
    assert errors == [
        ("wrong.cts", "3", "TS2322"),  # secondsAfterEdit: "5"
        ("wrong.mts", "3", "TS2322"),  # rolloutId: 42
        ("wrong.mts", "4", "TS2353"),  # retries: not an option
    ], wrong.stdout
