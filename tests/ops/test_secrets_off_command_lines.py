"""H2: no secret on a command line. Any local user reads every process's
/proc/<pid>/cmdline, and SGLang's admin key swaps in weights the trainer never signed, so
SGLang's keys reach it through an owner-only file wherever it is started: compose and
Kubernetes (one script, run here for real with a stand-in for python), the SGLang rig, and
the embedded stack, whose every process's command line is searched for every secret."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from support import k8s

REPO = Path(__file__).resolve().parents[2]
SERVING_KEY = "serving-Key_0123456789abcdef"
ADMIN_KEY = "admin-Key_fedcba9876543210+/="
# Stands in for python: records what SGLang would be started with, as any user sees it.
STAND_IN = """#!/bin/sh
tr '\\0' '\\n' < /proc/$$/cmdline > "$RTRL_TEST_RECORD.cmdline"
env > "$RTRL_TEST_RECORD.environ"
"""


def sglang_scripts() -> dict[str, str]:
    """Every shell script that starts SGLang: compose's services and Kubernetes' containers."""
    compose = k8s.load_compose()["services"]
    scripts = {
        f"compose:{name}": service["command"][2].replace("$$", "$")
        for name, service in compose.items()
        if str(service.get("image", "")).startswith("${RTRL_SGLANG_IMAGE")
    }
    containers = k8s.containers(k8s.load_manifests())
    scripts |= {
        f"k8s:{name}": container["command"][2]
        for name, container in containers.items()
        if container["image"].startswith("lmsysorg/sglang")
    }
    assert len(scripts) == 4, sorted(scripts)
    return scripts


def run_script(
    script: str, tmp_path: Path, serving: str, admin: str
) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python").write_text(STAND_IN)
    (bin_dir / "python").chmod(0o700)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "RTRL_SGLANG_API_KEY": serving,
        "RTRL_SGLANG_ADMIN_API_KEY": admin,
        "RTRL_SGLANG_KEYS_FILE": str(tmp_path / "keys.yaml"),
        "RTRL_TEST_RECORD": str(tmp_path / "sglang"),
    }
    return subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.guarantee(7)
@pytest.mark.parametrize("where", sorted(sglang_scripts()))
def test_compose_and_kubernetes_start_sglang_with_its_keys_in_a_file_never_on_its_command_line(
    where, tmp_path
):
    """H2: compose and Kubernetes passed --api-key and --admin-api-key on SGLang's command line.
    Their script, run as the container runs it: SGLang's command line holds neither key, its
    environment neither, and it is told to read them from an owner-only file that holds both."""
    done = run_script(sglang_scripts()[where], tmp_path, SERVING_KEY, ADMIN_KEY)
    assert done.returncode == 0, done.stderr
    argv = (tmp_path / "sglang.cmdline").read_text().splitlines()
    assert "sglang.launch_server" in argv
    for key in (SERVING_KEY, ADMIN_KEY):
        assert not [arg for arg in argv if key in arg], (
            f"{where}: a key on the command line: {argv}"
        )
        assert key not in (tmp_path / "sglang.environ").read_text()
    keys = Path(argv[argv.index("--config") + 1])
    assert keys == tmp_path / "keys.yaml" and keys.stat().st_mode & 0o777 == 0o600
    assert yaml.safe_load(keys.read_text()) == {"api-key": SERVING_KEY, "admin-api-key": ADMIN_KEY}


@pytest.mark.guarantee(7)
@pytest.mark.parametrize(
    "serving",
    ["", "key\ntrust-remote-code: true", "key' \nx: '", "key with spaces"],
)
def test_a_key_that_could_add_a_flag_to_sglangs_file_is_refused(serving, tmp_path):
    """H2: the keys file is built from the environment; a key of anything but letters, digits
    and -._~+/= (or none) is refused before anything is written or started."""
    done = run_script(next(iter(sglang_scripts().values())), tmp_path, serving, ADMIN_KEY)
    assert done.returncode == 64 and "letters, digits" in done.stderr
    assert not (tmp_path / "keys.yaml").exists() and not (tmp_path / "sglang.cmdline").exists()


@pytest.mark.guarantee(7)
def test_no_manifest_puts_a_secret_on_a_command_line():
    """H2: whatever compose interpolates into a command and whatever Kubernetes expands
    ($(VAR)) in one is on the command line: neither may be a secret."""
    from support.compose import OPERATOR_ENV, load

    compose = load()
    for name, service in compose["services"].items():
        command = str(service.get("command", "")) + str(service.get("entrypoint", ""))
        leaked = [v for v, value in OPERATOR_ENV.items() if value in command]
        assert not leaked, f"compose {name}: {leaked} on its command line"
    for name, container in k8s.containers(k8s.load_manifests()).items():
        secrets = {
            var["name"]
            for var in container.get("env", [])
            if "secretKeyRef" in var.get("valueFrom", {})
        }
        argv = " ".join(container.get("command", []) + container.get("args", []))
        expanded = set(re.findall(r"(?<!\$)\$\((\w+)\)", argv))
        assert not expanded & secrets, f"k8s {name}: {expanded & secrets} on its command line"


@pytest.mark.guarantee(7)
def test_the_sglang_rig_gives_sglang_its_keys_in_a_file(tmp_path, monkeypatch):
    """H2: scripts/sglang_rig.py started SGLang with --api-key/--admin-api-key. Started here
    up to its spawn: the command line holds neither key, and names an owner-only file that
    holds both."""
    from support.sglang import rig

    spawned = {}

    class Spawned(Exception):
        pass

    def spawn(name, argv, log_path, env=None, port=None):
        spawned["argv"] = argv
        raise Spawned

    monkeypatch.setattr(rig, "ensure_installed", lambda home=None: tmp_path / "bin")
    monkeypatch.setattr(rig, "checkpoint_flags", lambda model_dir: ())
    monkeypatch.setattr(rig.procs, "spawn", spawn)
    with pytest.raises(Spawned):
        rig.start_server(
            tmp_path / "model",
            tmp_path / "sglang.log",
            api_key=SERVING_KEY,
            admin_api_key=ADMIN_KEY,
        )
    argv = [str(arg) for arg in spawned["argv"]]
    assert not [arg for arg in argv if SERVING_KEY in arg or ADMIN_KEY in arg], argv
    keys = Path(argv[argv.index("--config") + 1])
    assert keys.stat().st_mode & 0o777 == 0o600
    assert yaml.safe_load(keys.read_text()) == {"api-key": SERVING_KEY, "admin-api-key": ADMIN_KEY}


def _command_lines() -> dict[int, bytes]:
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out[int(entry.name)] = (entry / "cmdline").read_bytes()
            except OSError:  # gone, or not ours to read
                continue
    return out


@pytest.mark.guarantee(7)
@pytest.mark.integration
def test_no_process_of_the_embedded_stack_has_a_secret_on_its_command_line(tmp_path):
    """H2 on `rtrl up`: every process on the machine (the stack's services, their workers and
    renderers, Redis, the broker, the supervisor) is searched for every secret of the state
    directory's secrets.json and every key file the stack wrote."""
    from rich.console import Console

    from rtrl.ops import stack_secrets
    from rtrl.ops.lifecycle import down, up

    state_dir = tmp_path / "stack"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RTRL_STATE_DIR", str(state_dir))
        console = Console(file=open(os.devnull, "w"))
        stack = up(state_dir, console)
        try:
            secrets = stack_secrets.load(state_dir)
            assert secrets is not None
            values = {name: value for name, value in vars(secrets).items() if value}
            for path in state_dir.rglob("*key*"):
                if path.is_file():
                    for i, line in enumerate(path.read_text(errors="replace").splitlines()):
                        if len(line.strip()) >= 16:
                            values[f"{path.name}:{i}"] = line.strip()
            assert len(values) >= 12
            lines = _command_lines()
            pids = {stack.supervisor_pid, *stack.infra.values(), *(s.pid for s in stack.services)}
            assert pids <= set(lines), "the stack's own processes are among those searched"
            leaks = {
                (pid, name)
                for pid, line in lines.items()
                for name, value in values.items()
                if value.encode() in line
            }
            assert not leaks, leaks
        finally:
            down(state_dir, console)
