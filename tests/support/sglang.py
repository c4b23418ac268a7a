"""A real SGLang 0.5.23 server on this CPU, for the SGLang backend's tests: the rig that
installs and starts it (scripts/sglang_rig.py), and what the tests ask of a running one
(slower decode steps, a version pushed through its sidecar)."""

from __future__ import annotations

import importlib.util
import json
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from rtrl.inference.sglang_sidecar import SGLangSidecar


def _load_rig():
    path = Path(__file__).resolve().parents[2] / "scripts" / "sglang_rig.py"
    spec = importlib.util.spec_from_file_location("sglang_rig", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["sglang_rig"] = module
    spec.loader.exec_module(module)
    return module


rig = _load_rig()


def installed() -> None:
    """Install SGLang into its cached venv unless it is there; fail the test if that fails."""
    try:
        rig.ensure_installed()
    except Exception as exc:
        pytest.fail(
            f"SGLang {rig.SGLANG_VERSION} is not installed in {rig.sglang_home()} and installing it failed: {exc}\n"
            f"run `python scripts/sglang_rig.py install` to see the whole error"
        )


def push(sidecar: SGLangSidecar, weights: dict[str, torch.Tensor]) -> int:
    """Stage and apply the next version through ``sidecar``; return its number."""
    version = sidecar.applied_version + 1
    assert sidecar.stage(version, weights)
    assert sidecar.apply_pending() == version
    return version


def post(server, path: str, body: dict) -> None:
    request = urllib.request.Request(
        f"{server.url}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30):
        pass


@contextmanager
def slowed(server) -> Iterator[None]:
    """~25 ms per decode step, so a swap reliably lands mid-generation on a busy machine."""
    post(server, "/slow_down", {"forward_sleep_time": 0.025})
    try:
        yield
    finally:
        post(server, "/slow_down", {"forward_sleep_time": None})
