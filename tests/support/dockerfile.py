"""compose/Dockerfile read and replayed without a Docker engine (tests/ops/test_dockerfile.py).

The replay runs the image's own steps on this machine: WORKDIR and COPY into a scratch
directory standing for the image's filesystem (sources from a build context holding the
checkout's git-listed files, as compose's ``context: ..`` sends them), and each ``pip
install`` of a RUN into a fresh virtualenv standing for the image's Python, from the
image's working directory. What cannot run here is checked for its shape instead, and
anything the replay does not know fails it: an allow-list, so no step is skipped unseen.
"""

from __future__ import annotations

import json
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from support import dists

INSTRUCTIONS = {"FROM", "ENV", "WORKDIR", "COPY", "RUN", "USER", "ENTRYPOINT", "CMD"}
SHAPE_ONLY = {"groupadd", "useradd", "mkdir", "chown"}
"""Commands a RUN may hold besides ``pip install``: they set up the image's user and
directories, which a replay as this machine's user cannot, so their shape is checked."""

IMAGE_ONLY_ENV = {
    # Keeps pip's cache out of the image's layers. The replay keeps pip's cache: the
    # packages come from it instead of being fetched again.
    "PIP_NO_CACHE_DIR",
}
"""ENV variables the replay does not set, each for the reason above it."""

INDEX_FLAGS = {"--index-url", "-i", "--extra-index-url"}
"""Where the image's pip finds a pin (PyTorch's CPU index for torch): the pin is replayed,
the index is not. This machine's pip configuration finds the same build (the CPU wheel of
torch==2.13.0 on its own disk) and reaches no other index."""


class ReplayError(AssertionError):
    """A step the image build would fail at, or one the replay does not know."""


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    line: int

    def words(self) -> list[str]:
        return shlex.split(self.args)


def parse(text: str) -> list[Instruction]:
    """Instructions in order: continuation lines joined, comments and blank lines dropped."""
    found: list[Instruction] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        start = start or number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        found.append(Instruction(keyword.upper(), args.strip(), start))
        pending, start = "", 0
    return found


def commands(run: Instruction) -> list[list[str]]:
    """A RUN's commands, split at ``&&`` (the only shell operator the images use)."""
    split: list[list[str]] = [[]]
    for word in run.words():
        if word == "&&":
            split.append([])
        elif word in {";", "||", "|"} or word.startswith(("$(", "`")):
            raise ReplayError(f"line {run.line}: shell operator {word!r}: chain with && only")
        else:
            split[-1].append(word)
    return split


def env_pairs(env: Instruction) -> dict[str, str]:
    pairs = {}
    for word in env.words():
        name, equals, value = word.partition("=")
        if not equals:
            raise ReplayError(f"line {env.line}: ENV {word!r}: write ENV NAME=value")
        pairs[name] = value
    return pairs


def user(instructions: list[Instruction]) -> tuple[int, int]:
    """The numeric uid and gid the image runs as (its last USER); every USER must be numeric."""
    users = [i for i in instructions if i.keyword == "USER"]
    if not users:
        raise ReplayError("no USER: the image would run as root")
    for step in users:
        uid, _, gid = step.args.partition(":")
        if not (uid.isdigit() and gid.isdigit()):
            raise ReplayError(f"line {step.line}: USER {step.args}: give uid:gid as numbers")
    return int(uid), int(gid)


def check(instructions: list[Instruction], context: Path) -> None:
    """Everything the replay can tell before running a step: each instruction and RUN
    command is one it knows, each COPY source is in ``context``, the user is numeric."""
    for step in instructions:
        if step.keyword not in INSTRUCTIONS:
            raise ReplayError(f"line {step.line}: the replay does not know {step.keyword}")
        if step.keyword == "ENV":
            env_pairs(step)
        elif step.keyword == "RUN":
            for command in commands(step):
                if command[:2] != ["pip", "install"] and command[0] not in SHAPE_ONLY:
                    raise ReplayError(f"line {step.line}: the replay does not know {command[0]!r}")
        elif step.keyword == "COPY":
            *sources, _ = step.words()
            for source in sources:
                if source.startswith("--"):
                    raise ReplayError(f"line {step.line}: COPY flags are not replayed: {step.args}")
                if not ((context / source).exists() or (context / source).is_symlink()):
                    raise ReplayError(f"line {step.line}: COPY {source}: not in the build context")
    user(instructions)


@dataclass
class Replay:
    """What a replay left: the image's filesystem, its Python, the state of its build."""

    root: Path
    """Stands for the image's /."""
    venv: Path
    workdir: str = "/"
    env: dict[str, str] = field(default_factory=dict)
    shape_only: list[list[str]] = field(default_factory=list)
    """The RUN commands checked, not run (SHAPE_ONLY)."""
    pip_installs: list[list[str]] = field(default_factory=list)
    """Each pip install as replayed (index flags dropped)."""
    entrypoint: list[str] = field(default_factory=list)

    def path(self, image_path: str) -> Path:
        """Where an absolute or WORKDIR-relative path of the image is in the replay."""
        absolute = image_path if image_path.startswith("/") else f"{self.workdir}/{image_path}"
        return self.root / absolute.lstrip("/")

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"


def replay(dockerfile: Path, context: Path, scratch: Path, *, pip_flags: tuple[str, ...] = ()):
    """Run ``dockerfile``'s steps with ``context`` as the build context; ``pip_flags`` go to
    every pip install (``--dry-run``: resolve each step, install nothing)."""
    steps = parse(dockerfile.read_text())
    check(steps, context)
    state = Replay(root=scratch / "image", venv=scratch / "venv")
    state.root.mkdir(parents=True)
    dists.make_venv(state.venv)
    for step in steps:
        if step.keyword == "WORKDIR":
            state.workdir = str(Path(state.workdir, step.args))
            state.path(".").mkdir(parents=True, exist_ok=True)
        elif step.keyword == "ENV":
            pairs = env_pairs(step)
            state.env.update({k: v for k, v in pairs.items() if k not in IMAGE_ONLY_ENV})
        elif step.keyword == "COPY":
            _copy(step, context, state)
        elif step.keyword == "RUN":
            for command in commands(step):
                _run(step, command, state, pip_flags)
        elif step.keyword == "ENTRYPOINT":
            state.entrypoint = json.loads(step.args)
    return state


def _copy(step: Instruction, context: Path, state: Replay) -> None:
    *sources, dest = step.words()
    target = state.path(dest)
    for source in sources:
        found = context / source
        if found.is_dir():
            shutil.copytree(found, target, symlinks=True, dirs_exist_ok=True)
        else:
            into = target / found.name if dest.endswith("/") else target
            into.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(found, into, follow_symlinks=False)


def _run(step: Instruction, command: list[str], state: Replay, pip_flags: tuple[str, ...]):
    if command[:2] != ["pip", "install"]:
        state.shape_only.append(command)
        return
    args, words = [], iter(command[2:])
    for word in words:
        if word in INDEX_FLAGS:
            next(words)
        elif not word.startswith(tuple(f"{flag}=" for flag in INDEX_FLAGS)):
            args.append(word)
    state.pip_installs.append(args)
    argv = [str(state.python), "-m", "pip", "install", "-q", *pip_flags, *args]
    answer = dists.run(argv, state.venv, state.path("."), env=state.env)
    if answer.returncode != 0:
        raise ReplayError(
            f"line {step.line}: RUN pip install {' '.join(args)} failed:\n{answer.stderr[-3000:]}"
        )
