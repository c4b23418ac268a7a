"""`rtrl bench loop`: how fast a user's behaviour becomes weights the fleet serves.

For every treatment version published during the run: the event time of the last
event of the newest rollout it trained on (the manifest records it) until every
inference worker serves that version or a newer one (workers record the moment a
version goes live; a worker may skip straight to a newer version, which counts).
The reward window is the floor of this latency, so the result is also reported as a
ratio against it.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import redis
from rich.console import Console
from rich.table import Table

from rtrl.v1 import weights_pb2

ARM = "treatment"


@dataclass(frozen=True)
class VersionLatency:
    version: int
    trained_through_event_ts_ms: int
    published_ts_ms: int
    live_ts_ms: int

    @property
    def event_to_live_s(self) -> float:
        return (self.live_ts_ms - self.trained_through_event_ts_ms) / 1000

    @property
    def publish_to_live_s(self) -> float:
        return (self.live_ts_ms - self.published_ts_ms) / 1000


def live_times(applied: dict[int, dict[str, int]]) -> dict[int, int]:
    """Version -> when every worker served it or a newer one.

    applied maps version -> {worker_id: unix ms it went live on that worker}.
    """
    workers = {w for per_version in applied.values() for w in per_version}
    result = {}
    for version in applied:
        per_worker = []
        for worker in workers:
            times = [ts for v, pw in applied.items() if v >= version for w, ts in pw.items() if w == worker]
            if not times:
                break
            per_worker.append(min(times))
        else:
            result[version] = max(per_worker)
    return result


def collect(redis_url: str, since_ms: int) -> list[VersionLatency]:
    client = redis.Redis.from_url(redis_url)
    try:
        applied: dict[int, dict[str, int]] = {}
        for key in client.scan_iter(f"rtrl:applied:{ARM}:*"):
            version = int(key.decode().rsplit(":", 1)[1])
            applied[version] = {w.decode(): int(ts) for w, ts in client.hgetall(key).items()}
        live = live_times(applied)
        rows = []
        for key in client.scan_iter(f"rtrl:ws:{ARM}:manifest:*"):
            manifest = weights_pb2.Manifest.FromString(client.get(key))
            if manifest.trained_through_event_ts_ms <= 0 or manifest.created_ts_ms < since_ms:
                continue
            if manifest.version in live:
                rows.append(VersionLatency(manifest.version, manifest.trained_through_event_ts_ms, manifest.created_ts_ms, live[manifest.version]))
        return sorted(rows, key=lambda r: r.version)
    finally:
        client.close()


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else float("nan")


def summarize(rows: list[VersionLatency], versions_published: int, reward_window_s: float) -> dict:
    e2l = [r.event_to_live_s for r in rows]
    p2l = [r.publish_to_live_s for r in rows]
    p50 = statistics.median(e2l) if e2l else float("nan")
    return {
        "p50_event_to_live_s": round(p50, 3),
        "p95_event_to_live_s": round(_quantile(e2l, 0.95), 3),
        "versions_published": versions_published,
        "versions_live_on_every_worker": len(rows),
        "p50_publish_to_live_s": round(statistics.median(p2l), 3) if p2l else None,
        "reward_window_s": reward_window_s,
        "p50_event_to_live_vs_reward_window": round(p50 / reward_window_s, 2) if reward_window_s else None,
        "versions": [asdict(r) | {"event_to_live_s": r.event_to_live_s} for r in rows],
    }


def run(state_dir: Path, duration_s: float, out: Path, console: Console) -> dict:
    from reward_stream.config import RewardStreamSettings
    from rtrl.demo import run_product
    from rtrl.health import running_stack
    from rtrl.lifecycle import down, up

    started_here = running_stack(state_dir) is None
    stack = up(state_dir, console)
    try:
        since_ms = int(time.time() * 1000)
        run_product(stack, duration_s, console)
        time.sleep(3)  # let the last versions reach every worker
        rows = collect(stack.redis_url, since_ms)
        client = redis.Redis.from_url(stack.redis_url)
        latest = int(client.get(f"rtrl:ws:{ARM}:latest") or -1)
        published = sum(
            1 for key in client.scan_iter(f"rtrl:ws:{ARM}:manifest:*")
            if weights_pb2.Manifest.FromString(client.get(key)).created_ts_ms >= since_ms
        )
        client.close()
    finally:
        if started_here:
            down(state_dir, console)
    result = summarize(rows, published, RewardStreamSettings().window_s)
    result["latest_version"] = latest
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    table = Table(title=f"bench loop ({duration_s / 60:.1f} min) -> {out}", title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in result.items():
        if k != "versions":
            table.add_row(k, str(v))
    console.print(table)
    return result
