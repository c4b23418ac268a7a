"""The real ingest gateway for the client SDK tests, driven through scripts/ingest_rig.py.

The rig (Tansu, redis-server, the gateway as production runs it) needs the server's
interpreter; the Python SDK under test may run on another one (tests/clients/
test_client_pythons.py runs its tests under Python 3.10-3.13 in virtualenvs holding only
rtrl-client). So this module imports nothing of rtrl: it starts the rig with
``RTRL_SERVER_PYTHON`` (by default this interpreter) and speaks its JSON lines, as the
TypeScript SDK's tests do (clients/typescript/test/support/rig.mjs).
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[2]
RIG = REPO / "scripts" / "ingest_rig.py"

_SAMPLE = re.compile(r"^(\w+)\{([^}]*)\} (\S+)$")


def server_python() -> str:
    """The interpreter that runs the rig: one with rtrl installed (``RTRL_SERVER_PYTHON``,
    else this one: the main suite's)."""
    python = os.environ.get("RTRL_SERVER_PYTHON", sys.executable)
    assert Path(python).exists(), f"RTRL_SERVER_PYTHON={python} does not exist: make install"
    return python


class IngestRig:
    """One rig: a gateway on fixed ports, killable and restartable, and its broker."""

    def __init__(self, *, cors_origins: tuple[str, ...] = ()) -> None:
        origins = [arg for origin in cors_origins for arg in ("--cors-origin", origin)]
        self._proc = subprocess.Popen(
            [server_python(), str(RIG), *origins],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        ready = self._read()
        assert ready.get("ready"), ready
        self.url: str = ready["url"]
        self.metrics_url: str = ready["metrics_url"]
        self.api_key: str = ready["api_key"]
        self.log = Path(ready["log"])
        self.http_port = int(urlsplit(self.url).port or 0)
        self.starts = 1

    def kill(self) -> None:
        """SIGKILL the gateway: nothing is drained."""
        self._command("kill")

    def start(self, *, wait: bool = True) -> None:
        """Start the gateway again on the same ports; ``wait``: until it listens."""
        self._command("start", wait=wait)
        self.starts += 1

    def key(
        self, client_id: str, *, rate_per_s: float | None = None, burst: float | None = None
    ) -> str:
        return self._command("key", client_id=client_id, rate_per_s=rate_per_s, burst=burst)["key"]

    def count(self) -> collections.Counter[str]:
        """How many times each event_id is on the telemetry topics."""
        return collections.Counter(self._command("count")["counts"])

    def claims(self) -> set[str]:
        """Event ids claimed and not settled: what a killed gateway may have produced
        without answering. The recovery sweep settles them from the topic."""
        return set(self._command("claims")["claims"])

    def counters(self) -> dict[str, Any]:
        """What the running gateway process answered since it started (GET /healthz)."""
        with urllib.request.urlopen(f"{self.url}/healthz", timeout=5) as response:
            return json.load(response)

    def sdk_events(self) -> dict[tuple[str, str, str], float]:
        """``rtrl_ingest_sdk_events_total`` from the gateway's Prometheus page, by
        (sdk, sdk_version, outcome)."""
        with urllib.request.urlopen(self.metrics_url, timeout=5) as response:
            page = response.read().decode()
        return sdk_events(page)

    def stop(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()  # EOF: the rig stops its processes and exits
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.terminate()
                self._proc.wait(timeout=15)

    def _command(self, cmd: str, **arguments: Any) -> dict[str, Any]:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps({"cmd": cmd, **arguments}) + "\n")
        self._proc.stdin.flush()
        answer = self._read()
        assert answer.get("ok"), f"rig {cmd}: {answer.get('error')}"
        return answer

    def _read(self) -> dict[str, Any]:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        assert line, f"the ingest rig exited ({self._proc.poll()}): its stderr is above"
        return json.loads(line)


def sdk_events(page: str) -> dict[tuple[str, str, str], float]:
    """The ``rtrl_ingest_sdk_events_total`` samples of a Prometheus text page."""
    samples = {}
    for line in page.splitlines():
        sample = _SAMPLE.match(line)
        if sample is None or sample[1] != "rtrl_ingest_sdk_events_total":
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', sample[2]))
        samples[(labels["sdk"], labels["sdk_version"], labels["outcome"])] = float(sample[3])
    return samples
