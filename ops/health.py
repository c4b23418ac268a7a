"""Health of the running stack, from the supervisor's plan and the services' heartbeats."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from rtrl import heartbeat
from rtrl.ops.stack import StackFile, stack_path


@dataclass(frozen=True)
class ComponentHealth:
    """Produced by check; consumed by `rtrl status` (its table and --json) and `rtrl up`'s wait."""

    name: str
    healthy: bool
    detail: str
    beat: heartbeat.Beat | None = None
    """The component's newest heartbeat, for a service that sent one since the stack started."""


def pid_alive(pid: int) -> bool:
    """True if pid runs (a zombie, exited but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def running_stack(state_dir: Path) -> StackFile | None:
    """The stack described by state_dir/stack.json if its supervisor is alive."""
    path = stack_path(state_dir)
    if not path.exists():
        return None
    stack = StackFile.read(path)
    return stack if pid_alive(stack.supervisor_pid) else None


def ready(beat: heartbeat.Beat) -> tuple[bool, str]:
    """Whether a service with this beat can do its job, and what to say about it."""
    if isinstance(beat, heartbeat.InferenceBeat):
        versions = beat.versions
        ok = beat.ready and all(versions.get(arm, -1) >= 0 for arm in ("control", "treatment"))
        return (
            ok,
            f"control v{versions.get('control', '-')}, treatment v{versions.get('treatment', '-')}",
        )
    if isinstance(beat, heartbeat.TrainerBeat):
        return beat.version >= 0, f"step {beat.step}, published v{beat.version}"
    if isinstance(beat, heartbeat.RewardStreamBeat) and not beat.assigned:
        # The embedded stack's one joiner owns every partition once its group has
        # formed; until then the first rollouts' rewards would wait for it.
        return False, "waiting for partitions"
    return True, ""


def check(stack: StackFile) -> list[ComponentHealth]:
    client = redis.Redis.from_url(stack.redis_url_as("operator"), socket_timeout=2)
    try:
        read, unreadable = heartbeat.read_checked(client)
        beats = {beat.name: beat for beat in read}
        invalid = {beat.name: beat.reason for beat in unreadable}
    except redis.RedisError as exc:
        beats, invalid = {}, {}
        redis_detail = f"unreachable: {exc}"
    else:
        redis_detail = "ok"
    finally:
        client.close()
    rows = [
        ComponentHealth("tansu", pid_alive(stack.infra["tansu"]), stack.kafka_bootstrap),
        ComponentHealth(
            "redis", pid_alive(stack.infra["redis"]) and redis_detail == "ok", redis_detail
        ),
    ]
    now = time.time()
    for spec in stack.services:
        beat = beats.get(spec.key)
        if beat is not None and beat.ts < stack.started_ts:
            beat = None  # left in the durable Redis by the previous run's process
        if spec.state == "failed":
            rows.append(ComponentHealth(spec.key, False, f"failed after {spec.restarts} restarts"))
        elif spec.key in invalid:
            rows.append(ComponentHealth(spec.key, False, f"invalid heartbeat: {invalid[spec.key]}"))
        elif beat is None:
            rows.append(
                ComponentHealth(
                    spec.key, False, "no heartbeat yet" if pid_alive(spec.pid) else "process down"
                )
            )
        else:
            ok, detail = ready(beat.beat)
            rows.append(
                ComponentHealth(
                    spec.key, ok, detail or f"heartbeat {now - beat.ts:.1f} s ago", beat.beat
                )
            )
    return rows


def main() -> None:
    """``python -m rtrl.ops.health SERVICE``: exit 0 if this instance's heartbeat is in Redis
    (a container health check; the instance is RTRL_INSTANCE, the hostname in compose/)."""
    import sys

    from rtrl.config import StackSettings

    if len(sys.argv) != 2:
        sys.exit("usage: python -m rtrl.ops.health SERVICE")
    settings = StackSettings()
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=3)
    try:
        beat = heartbeat.read_one(client, sys.argv[1], settings.instance)
    except heartbeat.HeartbeatError as error:
        sys.exit(f"{sys.argv[1]}:{settings.instance}: invalid heartbeat: {error}")
    finally:
        client.close()
    if beat is None:
        sys.exit(f"no heartbeat for {sys.argv[1]}:{settings.instance}")
    ok, detail = ready(beat.beat)
    if not ok:
        sys.exit(f"{sys.argv[1]}:{settings.instance} not ready: {detail}")


if __name__ == "__main__":
    main()
