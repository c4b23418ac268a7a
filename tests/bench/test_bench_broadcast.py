"""`rtrl bench broadcast` end to end on tiny versions: real server, relays and probe processes.

Timings are only checked for being measured (positive, one per topology); what is
checked exactly is what does not depend on the machine: every probe got every
version, and the server's egress per version is one copy per direct subscriber but
one per relay however many subscribers sit behind the relays.
"""

from __future__ import annotations

import json

import pytest
import torch
from rich.console import Console

from rtrl.bench import broadcast as bench_broadcast
from rtrl.bench import codec as bench_codec
from rtrl.bench import report

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def tiny_versions(steps: int, keep: int, seed: int = 0):
    versions = [{"w": torch.zeros(4096, dtype=torch.bfloat16), "b": torch.ones(16)}]
    for step in range(1, keep):
        nxt = {name: tensor.clone() for name, tensor in versions[-1].items()}
        nxt["w"][step * 7 : step * 7 + 5] += 1.0
        versions.append(nxt)
    return versions


def test_bench_broadcast_measures_every_topology(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_codec, "minilm_versions", tiny_versions)
    monkeypatch.setattr(bench_broadcast, "FANOUTS", (1, 2, 4))
    out = tmp_path / "broadcast.json"
    with open(tmp_path / "console.txt", "w") as screen:
        results = bench_broadcast.run(out, Console(file=screen), rounds=2)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report.as_json(results)))
    shapes = [(t.mode, t.relays, t.subscribers) for t in results.topologies]
    per_mode = [(0, 1), (0, 2), (0, 4), (2, 2), (2, 4)]
    assert shapes == [(mode, *shape) for mode in ("connections", "processes") for shape in per_mode]
    assert all(t.delivery_s > 0 and t.rounds == 2 for t in results.topologies)
    copies = {
        (t.mode, t.relays, t.subscribers): t.server_copies_per_version for t in results.topologies
    }
    for mode in ("connections", "processes"):
        assert [copies[(mode, *shape)] for shape in per_mode] == [1, 2, 4, 2, 2]
    assert None not in (
        results.fanout_4_vs_1,
        results.fanout_4_vs_1_relayed,
        results.fanout_4_vs_1_processes,
    )
    assert results.fanout_8_vs_1 is None  # FANOUTS left 8 out: not measured
    assert results.delta_bytes > 0 and results.keyframe_bytes > 0
