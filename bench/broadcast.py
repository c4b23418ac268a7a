"""`rtrl bench broadcast`: how long one new version takes to reach 1, 2, 4 and 8 workers.

Real processes on loopback: redis-server, the weight_sync server, optionally two
relays, and subscriber probes (rtrl.ops.broadcast_probe). The versions
are the MiniLM fine-tune of `rtrl bench codec` (22.7 M bf16 weights): a keyframe
first, which every subscriber must hold before timing starts, then deltas of about
180 KB, the steady state of real-time RL.

Delivery time of a version = from the moment the trainer's Publish call starts
(after encoding) until the last subscriber holds the whole blob, checksum-verified;
the median over rounds. It includes the upload and the commit, which cost the same
whatever the fan-out.

Subscribers are measured two ways. ``connections``: one probe process holds every
subscriber's own connection, so the server sees N independent streams while the
receiving side costs this machine little (in production each worker has its own
CPUs); this gives ``fanout_N_vs_1``. ``processes``: a process per subscriber, as
workers are, all sharing this machine's cores with the server and relays; this
gives ``fanout_N_vs_1_processes``, the pessimistic figure. Probes do not decode:
decoding is each worker's own CPU work (`rtrl bench codec` measures it), and eight
decoders on a 2-core machine would measure the machine, not the broadcast.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import redis
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from rtrl import heartbeat, procs, signing
from rtrl.bench import report
from rtrl.config import StackSettings

if TYPE_CHECKING:
    from rtrl.bench.codec import Weights

FANOUTS = (1, 2, 4, 8)
PROBE_MODULE = "rtrl.ops.broadcast_probe"
RELAYS = 2


MODES = ("connections", "processes")


@dataclass(frozen=True)
class Topology:
    subscribers: int
    relays: int
    mode: str
    """``connections``: one probe process holds every subscriber's connection;
    ``processes``: a process per subscriber, as a fleet of workers would be."""

    @property
    def arm(self) -> str:
        return f"{'relayed' if self.relays else 'direct'}-{self.mode}-{self.subscribers}"


# Produced by run, one per topology; part of BroadcastResult.
@dataclass(frozen=True)
class TopologyResult:
    mode: str
    """Topology.mode: how the subscribers were held (``connections`` or ``processes``)."""
    subscribers: int
    relays: int
    """Relays between the server and the subscribers; 0 for direct subscriptions."""
    delivery_s: float
    """Median over rounds: the Publish call's start until the last subscriber holds the version."""
    first_delivery_s: float
    """The same until the first subscriber holds it."""
    rounds: int
    server_copies_per_version: float
    """The server's egress during the topology's run, in copies of the arm's versions."""


# Produced by run; written to bench/results/broadcast.json; read by its test and docs/benchmarks.md.
# The fanout_* fields are for FANOUTS = (1, 2, 4, 8); a figure FANOUTS leaves out is None.
@dataclass(frozen=True)
class BroadcastResult:
    delta_bytes: int
    """Median size of the deltas broadcast."""
    keyframe_bytes: int
    rounds: int
    """Deltas timed per topology."""
    topologies: tuple[TopologyResult, ...]
    fanout_2_vs_1: float | None
    """delivery_s to 2 direct subscribers over delivery_s to 1 (``connections``)."""
    fanout_2_vs_1_relayed: float | None
    """delivery_s to 2 subscribers behind the relays over delivery_s to 1 direct."""
    fanout_4_vs_1: float | None
    fanout_4_vs_1_relayed: float | None
    fanout_8_vs_1: float | None
    fanout_8_vs_1_relayed: float | None
    fanout_2_vs_1_processes: float | None
    """The same ratios with a process per subscriber (``processes``)."""
    fanout_2_vs_1_relayed_processes: float | None
    fanout_4_vs_1_processes: float | None
    fanout_4_vs_1_relayed_processes: float | None
    fanout_8_vs_1_processes: float | None
    fanout_8_vs_1_relayed_processes: float | None


@dataclass(frozen=True)
class Delivery:
    """What run_topology measured; run adds the server's egress to make a TopologyResult."""

    delivery_s: float
    first_delivery_s: float
    rounds: int


class Probes:
    """The subscribers of one topology and what they wrote: one process per subscriber
    (``processes``), or one process holding every subscriber's connection (``connections``)."""

    def __init__(self, addrs: list[str], arm: str, workdir: Path, mode: str) -> None:
        prefix = workdir / f"{arm}-{mode}"
        if mode == "processes":
            self.files = [Path(f"{prefix}{i}-0.jsonl") for i in range(len(addrs))]
            groups = [(f"{prefix}{i}", [addr]) for i, addr in enumerate(addrs)]
        else:
            self.files = [Path(f"{prefix}-{i}.jsonl") for i in range(len(addrs))]
            groups = [(str(prefix), addrs)]
        self._seen: dict[Path, dict[int, float]] = {}
        self._read_to: dict[Path, int] = {}
        self.procs = [
            procs.spawn(
                f"probe-{i}",
                [sys.executable, "-m", "rtrl.ops.broadcast_probe", out_prefix, arm, *group],
                Path(f"{out_prefix}.log"),
            )
            for i, (out_prefix, group) in enumerate(groups)
        ]

    def delivered(self, version: int, timeout_s: float = 60.0) -> list[float]:
        """Each probe's delivery time of ``version``, waiting until all have it."""
        deadline = time.monotonic() + timeout_s
        while True:
            times = [self._delivered(out, version) for out in self.files]
            arrived = [t for t in times if t is not None]
            if len(arrived) == len(times):
                return arrived
            if time.monotonic() > deadline:
                reached = sum(t is not None for t in times)
                raise TimeoutError(
                    f"v{version} reached {reached} of {len(times)} subscribers in {timeout_s} s"
                )
            time.sleep(0.02)

    def _delivered(self, out: Path, version: int) -> float | None:
        """Read only what the probe appended since the last look (whole lines)."""
        seen = self._seen.setdefault(out, {})
        if version not in seen and out.exists():
            with out.open("rb") as lines:
                lines.seek(self._read_to.get(out, 0))
                for line in lines:
                    if not line.endswith(b"\n"):
                        break
                    self._read_to[out] = self._read_to.get(out, 0) + len(line)
                    record = json.loads(line)
                    seen[record["version"]] = record["delivered"]
        return seen.get(version)

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()


def run_topology(
    topology: Topology,
    server_addr: str,
    relay_addrs: list[str],
    versions,
    stack: StackSettings,
    workdir: Path,
) -> Delivery:
    from rtrl.weight_sync.client import Publisher

    addrs = (
        [relay_addrs[i % len(relay_addrs)] for i in range(topology.subscribers)]
        if topology.relays
        else [server_addr] * topology.subscribers
    )
    probes = Probes(addrs, topology.arm, workdir, topology.mode)
    publisher = Publisher(
        server_addr,
        stack.weight_sync_token.get_secret_value(),
        topology.arm,
        keyframe_every=1000,
        signing_key=signing.generate_private_key(),
    )  # its probes count bytes, they do not verify
    try:
        publisher.publish(versions[0])
        probes.delivered(0)
        times, firsts = [], []
        for version, weights in enumerate(versions[1:], start=1):
            time.sleep(0.2)  # let every stream settle back into waiting
            publisher.publish(weights)
            published = publisher.last_upload_started_s
            delivered = probes.delivered(version)
            times.append(max(delivered) - published)
            firsts.append(min(delivered) - published)
        return Delivery(statistics.median(times), statistics.median(firsts), len(times))
    finally:
        publisher.close()
        probes.stop()


def server_bytes_sent(client: redis.Redis, instance: str) -> int:
    time.sleep(1.2)  # one heartbeat interval, so the figure is current
    beat = heartbeat.read_one(client, "weight_sync", instance)
    return (
        beat.beat.bytes_sent
        if beat is not None and isinstance(beat.beat, heartbeat.WeightSyncBeat)
        else 0
    )


# Produced by encode_versions; read by run and measure.
@dataclass(frozen=True)
class Versions:
    """The weights to broadcast, and the sizes of their blobs as the codec encodes them."""

    weights: list[Weights]
    """State dicts: a keyframe's, then one per round and more (minilm_versions)."""
    keyframe_bytes: int
    delta_sizes: tuple[int, ...]

    @property
    def total_bytes(self) -> int:
        """One copy of every version: the unit of the server's egress."""
        return self.keyframe_bytes + sum(self.delta_sizes)


def encode_versions(rounds: int, console: Console) -> Versions:
    from rtrl.bench.codec import minilm_versions
    from rtrl.weight_sync import codec

    with console.status("MiniLM: fine-tuning for the versions to broadcast"):
        weights = minilm_versions(5 + rounds, keep=1 + rounds)
    return Versions(
        weights,
        keyframe_bytes=len(codec.encode(None, weights[0]).blob),
        delta_sizes=tuple(
            len(codec.encode(parent, new).blob) for parent, new in itertools.pairwise(weights)
        ),
    )


def topologies() -> list[Topology]:
    """Every mode, direct and relayed, at each of FANOUTS the relays can serve."""
    return [
        Topology(n, relays, mode)
        for mode in MODES
        for relays in (0, RELAYS)
        for n in FANOUTS
        if n >= max(relays, 1)
    ]


# Produced by servers; read by measure.
@dataclass(frozen=True)
class Servers:
    """What the subscribers reach: the server directly, or one of the relays."""

    stack: StackSettings
    server_addr: str
    relay_addrs: list[str]


@contextmanager
def servers(workdir: Path, relayed: list[Topology]) -> Iterator[Servers]:
    """redis-server, the weight_sync server and RELAYS relays carrying the ``relayed``
    topologies' arms, each listening before this yields; stopped in reverse order."""
    redis_proc = procs.start_redis(workdir / "redis", workdir / "redis.log")
    stack = StackSettings(
        redis_url=f"redis://127.0.0.1:{redis_proc.port}/0",
        state_dir=workdir / "state",
        instance="bench",
    )
    port = procs.free_port()
    env = {
        "RTRL_REDIS_URL": stack.redis_url,
        "RTRL_STATE_DIR": str(stack.state_dir),
        "RTRL_INSTANCE": "bench",
        "RTRL_WEIGHT_SYNC_PORT": str(port),
        "RTRL_WEIGHT_SYNC_GC_INTERVAL_S": "0",
    }
    started = [
        redis_proc,
        procs.spawn(
            "weight_sync",
            [sys.executable, "-m", "rtrl.weight_sync"],
            workdir / "weight_sync.log",
            env=env,
            port=port,
        ),
    ]
    server_addr = f"127.0.0.1:{port}"
    relay_arms = json.dumps([t.arm for t in relayed])
    relay_addrs = []
    try:
        for i in range(RELAYS):
            relay_port = procs.free_port()
            relay_env = {
                "RTRL_WEIGHT_SYNC_RELAY_UPSTREAM_ADDR": server_addr,
                "RTRL_WEIGHT_SYNC_RELAY_PORT": str(relay_port),
                "RTRL_WEIGHT_SYNC_RELAY_ARMS": relay_arms,
            }
            started.append(
                procs.spawn(
                    f"relay-{i}",
                    [sys.executable, "-m", "rtrl.weight_sync.relay"],
                    workdir / f"relay-{i}.log",
                    env=relay_env,
                    port=relay_port,
                )
            )
            relay_addrs.append(f"127.0.0.1:{relay_port}")
        for proc in started[1:]:
            assert proc.port is not None  # spawned with port= above
            procs.wait_for_port(proc.port)
        yield Servers(stack, server_addr, relay_addrs)
    finally:
        for proc in reversed(started):
            proc.stop()


def measure(
    measured: list[Topology],
    at: Servers,
    versions: Versions,
    workdir: Path,
    console: Console,
) -> list[TopologyResult]:
    """Each topology in turn, with the server's egress over its run."""
    results = []
    with (
        closing(redis.Redis.from_url(at.stack.redis_url)) as client,
        Progress(console=console, transient=True) as progress,
    ):
        task = progress.add_task("broadcasting", total=len(measured))
        for topology in measured:
            progress.update(task, description=topology.arm)
            before = server_bytes_sent(client, "bench")
            delivery = run_topology(
                topology, at.server_addr, at.relay_addrs, versions.weights, at.stack, workdir
            )
            # Egress in copies of the arm's versions: what the server's own streams carried.
            sent = server_bytes_sent(client, "bench") - before
            results.append(
                TopologyResult(
                    mode=topology.mode,
                    subscribers=topology.subscribers,
                    relays=topology.relays,
                    delivery_s=delivery.delivery_s,
                    first_delivery_s=delivery.first_delivery_s,
                    rounds=delivery.rounds,
                    server_copies_per_version=round(sent / versions.total_bytes, 3),
                )
            )
            progress.advance(task)
    return results


def run(out: Path, console: Console, rounds: int = 15) -> BroadcastResult:
    # The bench's own servers, relays and probes (which inherit this environment) share a pair
    # of tokens made for the run: weight_sync has no defaults.
    for name in ("RTRL_WEIGHT_SYNC_TOKEN", "RTRL_WEIGHT_SYNC_SUBSCRIBE_TOKEN"):
        os.environ.setdefault(name, secrets.token_urlsafe(24))
    versions = encode_versions(rounds, console)
    planned = topologies()
    with tempfile.TemporaryDirectory(prefix="rtrl-bench-broadcast-") as tmp:
        workdir = Path(tmp)
        with servers(workdir, [t for t in planned if t.relays]) as at:
            measured = measure(planned, at, versions, workdir, console)
    result = _result(measured, versions, rounds)
    report.write(out, result)
    _print(result, out, console)
    return result


def _result(measured: list[TopologyResult], versions: Versions, rounds: int) -> BroadcastResult:
    by = {(t.mode, t.relays, t.subscribers): t.delivery_s for t in measured}

    def fanout(n: int, mode: str = "connections", relays: int = 0) -> float | None:
        """Delivery to n subscribers over delivery to 1 direct one; None if not measured."""
        if (mode, relays, n) not in by:
            return None
        return round(by[(mode, relays, n)] / by[(mode, 0, 1)], 2)

    return BroadcastResult(
        delta_bytes=round(statistics.median(versions.delta_sizes)),
        keyframe_bytes=versions.keyframe_bytes,
        rounds=rounds,
        topologies=tuple(measured),
        fanout_2_vs_1=fanout(2),
        fanout_2_vs_1_relayed=fanout(2, relays=RELAYS),
        fanout_4_vs_1=fanout(4),
        fanout_4_vs_1_relayed=fanout(4, relays=RELAYS),
        fanout_8_vs_1=fanout(8),
        fanout_8_vs_1_relayed=fanout(8, relays=RELAYS),
        fanout_2_vs_1_processes=fanout(2, "processes"),
        fanout_2_vs_1_relayed_processes=fanout(2, "processes", RELAYS),
        fanout_4_vs_1_processes=fanout(4, "processes"),
        fanout_4_vs_1_relayed_processes=fanout(4, "processes", RELAYS),
        fanout_8_vs_1_processes=fanout(8, "processes"),
        fanout_8_vs_1_relayed_processes=fanout(8, "processes", RELAYS),
    )


def _print(result: BroadcastResult, out: Path, console: Console) -> None:
    base = {t.mode: t.delivery_s for t in result.topologies if t.relays == 0 and t.subscribers == 1}
    sizes = f"deltas ~{result.delta_bytes:,} B, keyframe {result.keyframe_bytes:,} B"
    table = Table(title=f"bench broadcast -> {out} ({sizes})", title_justify="left")
    for column in (
        "probes",
        "topology",
        "subscribers",
        "delivery (median)",
        "vs 1 direct",
        "server egress (copies)",
    ):
        table.add_column(column, justify="right")
    for t in result.topologies:
        name = f"{t.relays} relays" if t.relays else "direct"
        held_by = "1 process" if t.mode == "connections" else "1 per subscriber"
        table.add_row(
            held_by,
            name,
            str(t.subscribers),
            f"{t.delivery_s * 1000:.1f} ms",
            f"{t.delivery_s / base[t.mode]:.2f}",
            f"{t.server_copies_per_version:g}",
        )
    console.print(table)
