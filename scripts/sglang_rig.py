"""A real SGLang server on this CPU, for the SGLang backend's tests and by hand.

    python scripts/sglang_rig.py install   # SGLang 0.5.23 into its own venv (cached)
    python scripts/sglang_rig.py serve     # tiny policy model, serve until Ctrl-C
    python scripts/sglang_rig.py check     # serve, generate once, print timings, stop
    python scripts/sglang_rig.py check --model-dir DIR   # any HF checkpoint directory

SGLang pins a CUDA torch that conflicts with the project's CPU torch, so it lives in
its own venv under ``$RTRL_SGLANG_HOME`` (default ``~/.cache/rtrl/sglang-0.5.23``),
installed once per machine and marked finished by a stamp file. The served model is
the project's own policy (a character-vocabulary Llama) unless a checkpoint directory
is given (e.g. one ``rtrl model tiny DIR --family qwen3`` writes). Either way the
server runs with ``--skip-tokenizer-init``: token ids go in and out, and the tokenizer
stays on rtrl's side (inference.sglang_adapter.ServedModel).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from rtrl import procs

SGLANG_VERSION = "0.5.23"
STAMP_NAME = ".rtrl-installed"

# SGLang imports vllm._custom_ops on a non-CUDA device (the rotary-embedding kernel
# fallback); vllm itself does not install here. The stand-in satisfies the import and
# fails loudly if any of its ops were ever called, so a CPU run never silently
# depends on a kernel it does not have.
CUSTOM_OPS_STANDIN = '''"""Stand-in for vllm._custom_ops, written by rtrl's scripts/sglang_rig.py.

SGLang only imports these ops on CPU; calling one means a code path this rig does not
support was taken."""


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def op(*args, **kwargs):
        raise NotImplementedError(
            f"vllm._custom_ops.{name} was called, but this is rtrl's CPU stand-in without kernels"
        )

    op.__name__ = name
    return op
'''

# The smallest footprint that serves the tiny policy on 2 cores: no CUDA graphs, the
# torch attention kernels, a small fixed KV pool (SGLang's own sizing from free memory
# comes out negative on CPU, hence an explicit --mem-fraction-static), a handful of
# concurrent requests, and a scheduler that sleeps when idle instead of spinning a
# core. The radix (prefix) cache is off because in-place weight swaps keep the KV
# cache (flush_cache=false): a cached prefix would outlive the weights that made it.
SERVER_FLAGS = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--cuda-graph-backend-decode",
    "disabled",
    "--cuda-graph-backend-prefill",
    "disabled",
    "--max-total-tokens",
    "20000",
    "--mem-fraction-static",
    "0.05",
    "--max-running-requests",
    "8",
    "--chunked-prefill-size",
    "-1",
    "--disable-radix-cache",
    "--disable-overlap-schedule",
    "--skip-tokenizer-init",
    "--skip-server-warmup",
    "--sleep-on-idle",
    "--dtype",
    "float32",
    "--random-seed",
    "0",
)


def checkpoint_flags(model_dir: Path) -> tuple[str, ...]:
    """The flags read from the checkpoint's config.json: its context length, so SGLang
    accepts exactly the prompts + completions the model has positions for. A model that
    needs its own code is refused (CustomCodeRefused): SGLang is never given
    --trust-remote-code, and nothing here runs that code either."""
    from transformers import AutoConfig

    from rtrl.custom_code import refuse_custom_code
    from rtrl.policy import ModelSpec

    refuse_custom_code(model_dir)
    spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(model_dir, trust_remote_code=False))
    return ("--context-length", str(spec.max_positions))


def sglang_home() -> Path:
    """Where SGLang's venv lives: ``$RTRL_SGLANG_HOME`` or the per-user cache."""
    return Path(
        os.environ.get(
            "RTRL_SGLANG_HOME", Path.home() / ".cache" / "rtrl" / f"sglang-{SGLANG_VERSION}"
        )
    )


def ensure_installed(home: Path | None = None) -> Path:
    """Install SGLang into its venv unless a finished install is stamped; return its bin/.

    Serialized by a file lock, so a test run and a manual install on the same machine
    never run pip into the same venv at once. Re-running pip over a venv that already
    holds the pinned version is quick and does not download, so an unstamped install
    (e.g. one made by hand) is verified and stamped rather than redone."""
    home = home or sglang_home()
    bin_dir = home / "bin"
    stamp = home / STAMP_NAME

    def finished() -> bool:
        return stamp.exists() and stamp.read_text().strip() == f"sglang=={SGLANG_VERSION}"

    if finished():
        return bin_dir
    home.parent.mkdir(parents=True, exist_ok=True)
    with open(home.parent / f".{home.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if finished():
            return bin_dir
        if not (bin_dir / "python").exists():
            _run([sys.executable, "-m", "venv", str(home)], "creating SGLang's venv")
        _run(
            [str(bin_dir / "python"), "-m", "pip", "install", "-q", f"sglang=={SGLANG_VERSION}"],
            "pip install sglang (pulls ~11 GB of CUDA torch the first time)",
        )
        found = subprocess.run(
            [
                str(bin_dir / "python"),
                "-c",
                "import importlib.metadata as m; print(m.version('sglang'))",
            ],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        if found != SGLANG_VERSION:
            raise RuntimeError(
                f"{home}: expected sglang {SGLANG_VERSION} after install, found {found or 'nothing'}"
            )
        stamp.write_text(f"sglang=={SGLANG_VERSION}\n")
    return bin_dir


def _run(argv: list[str], what: str) -> None:
    print(f"sglang_rig: {what}", file=sys.stderr, flush=True)
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-30:])
        raise RuntimeError(f"{what} failed (exit {result.returncode}): {' '.join(argv)}\n{tail}")


def write_tiny_model(model_dir: Path, seed: int = 0) -> Path:
    """Save the project's policy model (default PolicyConfig) as a HF safetensors
    checkpoint SGLang can load. Weights are tied, so only embed_tokens is stored."""
    from rtrl.policy import PolicyConfig, build_model

    model_dir.mkdir(parents=True, exist_ok=True)
    build_model(PolicyConfig(), seed=seed).save_pretrained(model_dir, safe_serialization=True)
    return model_dir


def write_custom_ops_standin(root: Path) -> Path:
    """Write ``root/vllm/_custom_ops.py`` (see CUSTOM_OPS_STANDIN); put root on PYTHONPATH."""
    package = root / "vllm"
    package.mkdir(parents=True, exist_ok=True)
    (package / "_custom_ops.py").write_text(CUSTOM_OPS_STANDIN)
    return root


@dataclass
class SGLangServer:
    """A running ``sglang serve``; stop() ends its whole process group."""

    url: str
    proc: procs.Proc
    log_path: Path
    startup_s: float

    def rss_bytes(self) -> int:
        """Resident memory of the server and its children (scheduler, detokenizer)."""
        pids = subprocess.run(
            ["pgrep", "-g", str(self.proc.pid)], capture_output=True, text=True, check=False
        ).stdout.split()
        total = 0
        for pid in pids:
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            except FileNotFoundError:
                continue
        return total

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        self.proc.stop(timeout_s=15.0)


def keys_config(path: Path, api_key: str, admin_api_key: str) -> tuple[str, ...]:
    """SGLang's flags for its keys: ``--config`` naming an owner-only YAML file that holds
    them (SGLang reads its flags from it), or none without keys. Never the keys themselves:
    any local user reads a process's command line in /proc/<pid>/cmdline."""
    keys = {"api-key": api_key, "admin-api-key": admin_api_key}
    keys = {flag: value for flag, value in keys.items() if value}
    if not keys:
        return ()
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(descriptor, 0o600)
    with os.fdopen(descriptor, "w") as out:
        json.dump(keys, out)  # JSON is YAML: every key a quoted string, whatever it holds
    return ("--config", str(path))


def start_server(
    model_dir: Path,
    log_path: Path,
    port: int | None = None,
    *,
    weight_version: str = "-1",
    home: Path | None = None,
    timeout_s: float = 300.0,
    api_key: str = "",
    admin_api_key: str = "",
) -> SGLangServer:
    """Start ``sglang serve`` on ``model_dir`` (any Hugging Face checkpoint directory
    SGLang has the architecture of) and wait until /health_generate answers.

    ``weight_version`` labels the weights it starts with (SGLang's ``--weight-version``);
    responses report it in ``meta_info.weight_versions`` until the first update. The
    default, -1, precedes every version weight_sync publishes (they start at 0): the
    checkpoint on disk is the model's shape, not a trained version."""
    bin_dir = ensure_installed(home)
    port = port or procs.free_port()
    standin = write_custom_ops_standin(log_path.parent / "vllm-standin")
    argv = [
        str(bin_dir / "sglang"),
        "serve",
        "--model-path",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--weight-version",
        weight_version,
        *SERVER_FLAGS,
        *checkpoint_flags(model_dir),
        *keys_config(log_path.parent / "sglang-keys.yaml", api_key, admin_api_key),
    ]
    env = {"PYTHONPATH": str(standin), "TOKENIZERS_PARALLELISM": "false"}
    started = time.monotonic()
    proc = procs.spawn("sglang", argv, log_path, env=env, port=port)
    server = SGLangServer(f"http://127.0.0.1:{port}", proc, log_path, 0.0)
    deadline = started + timeout_s
    while True:
        if not proc.alive():
            raise RuntimeError(
                f"sglang serve exited with {proc.popen.returncode} while starting; log {log_path}:\n{server.log_tail()}"
            )
        if _healthy(server.url):
            server.startup_s = time.monotonic() - started
            return server
        if time.monotonic() > deadline:
            server.stop()
            raise TimeoutError(
                f"sglang serve not healthy after {timeout_s:.0f} s; log {log_path}:\n{server.log_tail()}"
            )
        time.sleep(1.0)


def _healthy(url: str) -> bool:
    """/health_generate runs one real token through the scheduler, not just the HTTP layer."""
    try:
        with urllib.request.urlopen(f"{url}/health_generate", timeout=30) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def _check(server: SGLangServer, model_dir: Path | None) -> None:
    from rtrl.inference.sglang_adapter import served_model

    body = {
        "input_ids": served_model(model_dir).encode("def add(a, b):"),
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 16},
        "return_logprob": True,
    }
    request = urllib.request.Request(
        f"{server.url}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    started = time.monotonic()
    with urllib.request.urlopen(request, timeout=60) as response:
        out = json.loads(response.read())
    print(
        f"generate: {len(out['output_ids'])} tokens in {time.monotonic() - started:.2f} s; "
        f"weight_versions={out['meta_info'].get('weight_versions')}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=("install", "serve", "check"))
    parser.add_argument(
        "--port", type=int, default=None, help="serve/check: port (default: a free one)"
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="serve/check: model and log directory (default: a temp dir)",
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="serve/check: a Hugging Face checkpoint directory to serve (default: the demo policy)",
    )
    args = parser.parse_args()

    # SIGTERM ends `serve` like Ctrl-C does, so the server never outlives the rig.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    bin_dir = ensure_installed()
    if args.command == "install":
        print(f"SGLang {SGLANG_VERSION} installed in {bin_dir.parent}")
        return
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="rtrl-sglang-"))
    model_dir = args.model_dir or write_tiny_model(workdir / "model")
    server = start_server(model_dir, workdir / "sglang.log", args.port)
    print(
        f"SGLang serving {model_dir} at {server.url} (ready in {server.startup_s:.1f} s, "
        f"RSS {server.rss_bytes() / 2**20:.0f} MiB, log {server.log_path})"
    )
    try:
        if args.command == "check":
            _check(server, args.model_dir)
        else:
            while server.proc.alive():
                time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
