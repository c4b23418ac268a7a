"""`rtrl bench join`'s agent loads: trajectories of 4k and 32k tokens beside the
single-turn rollout, as a worker writes them (rtrl/bulk.py: past the inline limit the
bulk goes to the rollout store and the record that travels names it).

For each load, in this process and in fresh ones:

* ``events_per_s``: Joiner.feed_record as the service runs it (every record's writer
  checked, every reward authenticated) on ``rollouts`` rollouts of three records each,
  every record delivered twice (a redelivery after a crash), then a tick that settles them;
* ``missing``/``doubled``: rewards against rollouts, which must be one each;
* ``pending_bytes``: what one pending rollout (its record and two events) adds to a
  joiner's resident memory, measured in a fresh process on ``pending`` rollouts whose
  window never closes; ``pending_bytes_inline`` the same had the whole record travelled;
* ``window_mb``: the memory of a 10-minute window at the demo's rollout rate
  (window × rate rollouts pending at once).
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from dataclasses import dataclass

from rtrl import topics
from rtrl.bench.join_load import event_signer, rollout_records, rollout_signer, signing_keys
from rtrl.reward_stream.authn import Authenticator
from rtrl.reward_stream.config import RewardStreamSettings
from rtrl.reward_stream.runtime import Joiner
from rtrl.v1 import reward_pb2

SIZES = (0, 4096, 32768)
"""Trajectory tokens of each load; 0 is today's single-turn rollout (bench/join_load.py)."""
DEMO_ROLLOUTS_PER_S = 78.0
"""The demo's rollout rate: `rtrl demo` at 5e84b50 recorded 28,034 rollouts in its 6 minutes
(two workers, both arms) on this 2-core machine."""
WINDOW_S = 600


# Produced by measure, one per load; part of JoinResult.
@dataclass(frozen=True)
class TrajectoryLoad:
    tokens: int
    """The trajectory's tokens; 0 for the single-turn load."""
    rollouts: int
    record_bytes: int
    """The rollout record as it travels (out of band past the inline limit)."""
    whole_record_bytes: int
    """The same rollout's record had it travelled whole."""
    reward_bytes: int
    events_per_s: int
    missing: int
    doubled: int
    pending_bytes: int
    pending_bytes_inline: int
    window_mb: float
    """A 10-minute window at the demo's rate: DEMO_ROLLOUTS_PER_S × 600 rollouts pending."""


def measure(rollouts: int = 500, pending: int = 2_000) -> tuple[TrajectoryLoad, ...]:
    signing_keys()
    return tuple(_load(tokens, rollouts, pending) for tokens in SIZES)


def _load(tokens: int, rollouts: int, pending: int) -> TrajectoryLoad:
    rate, rewards = _throughput(tokens, rollouts)
    ids = [r.rollout_id for r in rewards]
    per_pending = _pending_in_child(tokens, pending, inline=False)
    whole = rollout_records("x", 0, tokens, inline=True)[0][1]
    return TrajectoryLoad(
        tokens=tokens,
        rollouts=rollouts,
        record_bytes=len(rollout_records("x", 0, tokens)[0][1]),
        whole_record_bytes=len(whole),
        reward_bytes=max(r.ByteSize() for r in rewards),
        events_per_s=round(rate),
        missing=rollouts - len(set(ids)),
        doubled=len(ids) - len(set(ids)),
        pending_bytes=round(per_pending),
        pending_bytes_inline=round(_pending_in_child(tokens, max(pending // 10, 50), inline=True)),
        window_mb=round(per_pending * DEMO_ROLLOUTS_PER_S * WINDOW_S / 2**20, 1),
    )


def _throughput(tokens: int, rollouts: int) -> tuple[float, list[reward_pb2.RewardRecord]]:
    """Events per second through a checked joiner, each record delivered twice; the rewards."""
    settings = RewardStreamSettings()
    joiner = Joiner(
        settings.join_config(),
        signer=settings.reward_seal(),
        authenticator=Authenticator.of(settings),
    )
    seals = {topics.ROLLOUT: rollout_signer()}
    events = event_signer()
    base_ms = int(time.time() * 1000) - 3_600_000
    fed = []
    for i in range(rollouts):
        rollout_id = f"t{tokens}-{i:05d}"
        for topic, value in rollout_records(rollout_id, base_ms + 5 * i, tokens):
            headers = list(seals.get(topic, events).headers(value))
            fed.append((topic, i % 4, rollout_id.encode(), value, headers))
    now_ms = int(time.time() * 1000)
    out = []
    start = time.perf_counter()
    for offset, (topic, partition, key, value, headers) in enumerate([*fed, *fed]):
        out.extend(
            joiner.feed_record(
                topic, partition, offset, key, value, now_ms, headers=headers
            ).records
        )
    out.extend(joiner.tick(now_ms + 3_600_000))
    elapsed = time.perf_counter() - start
    assert joiner.counters.unauthenticated == 0
    rewards = [reward_pb2.RewardRecord.FromString(r.value) for r in out if r.topic == topics.REWARD]
    return 2 * len(fed) / elapsed, rewards


def _pending_in_child(tokens: int, rollouts: int, inline: bool) -> float:
    """pending_bytes, measured in a fresh interpreter (resident memory is per process)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rtrl.bench.join_trajectories",
            str(tokens),
            str(rollouts),
            str(int(inline)),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return float(json.loads(done.stdout)["pending_bytes"])


def _resident_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def pending_bytes(tokens: int, rollouts: int, inline: bool) -> float:
    """Resident bytes one pending rollout adds to a joiner whose windows never close: its
    three records built, fed and dropped one rollout at a time, so only the joiner keeps them."""
    settings = RewardStreamSettings(window_s=WINDOW_S, grace_s=30, max_wait_s=2 * WINDOW_S)
    joiner = Joiner(settings.join_config())
    rollout_records("warm", 0, tokens, inline)  # the trajectory template, outside the count
    ts_ms = int(time.time() * 1000)
    gc.collect()
    before = _resident_bytes()
    for i in range(rollouts):
        rollout_id = f"p{i:06d}"
        for offset, (topic, value) in enumerate(rollout_records(rollout_id, ts_ms, tokens, inline)):
            joiner.feed_record(topic, i % 4, 3 * i + offset, rollout_id.encode(), value, ts_ms)
    gc.collect()
    pending = sum(len(state.pending) for state in joiner.states.values())
    assert pending == rollouts, f"{pending} of {rollouts} rollouts pending"
    return (_resident_bytes() - before) / rollouts


def main() -> None:
    """python -m rtrl.bench.join_trajectories TOKENS ROLLOUTS INLINE: print pending_bytes."""
    tokens, rollouts, inline = (int(arg) for arg in sys.argv[1:4])
    signing_keys()
    print(json.dumps({"pending_bytes": pending_bytes(tokens, rollouts, bool(inline))}))


if __name__ == "__main__":
    main()
