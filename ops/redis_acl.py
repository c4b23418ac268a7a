"""The stack's Redis users: one per service, each held to the keys it uses; the default user off.

One definition for both stacks. `rtrl up` writes the ACL file from USERS into its state
directory (``redis/users.acl``, owner-only, each password of secrets.json as its SHA-256)
and starts its redis-server on it (start); ``python -m rtrl.ops.redis_acl`` prints
compose/redis-acl.sh, which writes the same users from RTRL_REDIS_PASSWORD_<USER> when
compose's Redis starts (tests/ops/test_compose.py fails when the committed script is
stale). A service (or whoever holds its password) thus cannot write what steers another
one: key records are the operator's alone, weight manifests weight_sync's, served-rollout
bindings the serving API's. tests/ops/test_redis_acl.py attacks each user on both.
"""

from __future__ import annotations

import hashlib
import os
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from rtrl import procs
from rtrl.weight_sync import registry

# Every service: plain reads and writes, scripts and transactions on its keys; nothing
# that reaches outside them (KEYS, FLUSHALL, CONFIG, DEBUG, ...: @dangerous).
SERVICE = (
    "resetkeys resetchannels -@all +@read +@write +@scripting +@transaction +@connection "
    "-@dangerous"
)


def beat(service: str) -> str:
    """The heartbeats ``service`` may write: its own (rtrl/heartbeat.py's key), never another
    service's, so no service can forge the beat `rtrl status` reads another one's state from.
    It may read them all (nothing in a beat is secret: tests/e2e/test_e2e.py searches them)."""
    return f"~rtrl:hb:{service}:* %R~rtrl:hb:*"


@dataclass(frozen=True)
class RedisUser:
    name: str
    """The service it is for (a service runs as the user of its own name), or ``operator``."""
    rules: str
    """Redis ACL rules after the password: keys (``~``, ``%R~`` read-only, ``%W~`` write-only),
    channels (``&``) and commands."""
    why: tuple[str, ...]
    """Why these keys: comment lines in compose's script."""


USERS: tuple[RedisUser, ...] = (
    RedisUser(
        "operator",
        "~* &* +@all",
        ("The operator (rtrl keys, status, report, the demo): everything.",),
    ),
    RedisUser(
        "ingest",
        f"{SERVICE} {beat('ingest')} ~rtrl:ingest:event:* ~rtrl:ingest:inflight ~rtrl:ingest:bucket:* "
        "~rtrl:privacy:* ~rtrl:ingest:private-users %R~rtrl:ingest:key:* "
        "%R~rtrl:ingest:client:* %R~rtrl:served:*",
        (
            "The gateway: dedup claims, its in-flight records, rate buckets, privacy counters; it",
            "reads key records and which client a rollout was served to. Its claim script names the",
            "private-users set among its keys, and Redis checks a script's keys for writing, so",
            "the gateway holds that set too (Redis ACLs cannot grant SADD without SREM).",
        ),
    ),
    RedisUser(
        "inference",
        f"{SERVICE} {beat('inference')} ~rtrl:ingest:bucket:* %W~rtrl:served:* ~rtrl:applied:* "
        "~rtrl:trajectory:* %R~rtrl:ingest:key:* %R~rtrl:ingest:private-users",
        (
            "The serving API: reads key records and the private-users set, spends rate buckets,",
            "records which client each rollout was served to, which versions it applied and",
            "which worker serves each agent's open trajectory.",
        ),
    ),
    RedisUser(
        "weight_sync",
        f"{SERVICE} +@pubsub {beat('weight_sync')} ~rtrl:ws:* &{registry.PUBLISHED_PATTERN}",
        (
            "The weight registry, and the channels that announce its versions. Redis matches",
            "a pattern subscription literally against channel rules, so the rule is the very",
            "pattern the servers subscribe to (which also matches each arm's channel).",
        ),
    ),
    RedisUser("trainer", f"{SERVICE} {beat('trainer')}", ("The rest only say they are alive.",)),
    RedisUser("reward_stream", f"{SERVICE} {beat('reward_stream')}", ()),
    RedisUser("analytics", f"{SERVICE} {beat('analytics')}", ()),
)

ACL_FILE = Path("redis") / "users.acl"
"""In the state directory, beside Redis's append-only file."""


DEFAULT_USER = "user default off ~* &* +@all"
"""Off: a client that has not logged in as one of USERS is refused every command (NOAUTH),
and no password logs in as ``default``. Yet with every permission, because Redis replays
its append-only file as ``default`` and re-checks each command of a MULTI/EXEC against that
user's permissions: without them, every transaction (the weight registry's, API key
records) is dropped when Redis restarts: silently on Redis 7.0 (redis/redis#14541), with a
crash reported on 7.2 (redis/redis#14156). tests/ops/test_redis_acl.py restarts both stacks'
Redis."""


def acl_lines(password: Callable[[str], str]) -> list[str]:
    """The ACL file's lines; ``password(user)`` gives each user's password clause
    (``>plain`` or ``#sha256``)."""
    return [DEFAULT_USER] + [
        f"user {user.name} on {password(user.name)} {user.rules}" for user in USERS
    ]


def write_acl_file(path: Path, passwords: Mapping[str, str]) -> None:
    """The ACL file for ``passwords`` (user -> password), owner-only, holding only each
    password's SHA-256: the file proves a password without giving it away."""
    unknown = set(passwords) - {user.name for user in USERS}
    if unknown:
        raise ValueError(f"no Redis user {sorted(unknown)} in rtrl.ops.redis_acl.USERS")
    lines = acl_lines(lambda name: "#" + hashlib.sha256(passwords[name].encode()).hexdigest())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    descriptor = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(descriptor, 0o600)  # a tmp file left by a crash keeps its old mode otherwise
    with os.fdopen(descriptor, "w") as out:
        out.write("\n".join(lines) + "\n")
    os.replace(tmp, path)


def start(state_dir: Path, passwords: Mapping[str, str], log_path: Path) -> procs.Proc:
    """The embedded stack's redis-server (durable, in ``state_dir/redis``) on a free port,
    answering only USERS with ``passwords``; the ACL file is written afresh on every start,
    so a password changed in secrets.json is the one Redis checks."""
    acl_path = state_dir / ACL_FILE
    write_acl_file(acl_path, passwords)
    return procs.start_redis(acl_path.parent, log_path, durable=True, acl_file=acl_path)


def url(address: str, user: str, password: str) -> str:
    """``address`` (``redis://host:port/db``, no credentials) as ``user``."""
    parts = urllib.parse.urlsplit(address)
    if parts.username or parts.password:
        raise ValueError("the Redis address already carries credentials")
    netloc = f"{urllib.parse.quote(user, safe='')}:{urllib.parse.quote(password, safe='')}@{parts.netloc}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


HEADER = """#!/bin/sh
# Generated by `python -m rtrl.ops.redis_acl` from ops/redis_acl.py (USERS); do not edit.
# Redis for the rtrl stack: one ACL user per service, each limited to the keys it uses,
# so a service (or whoever holds its password) cannot write what steers another one.
# The default user is off. Passwords come from the environment; the generated ACL file is
# owner-only. `rtrl up` starts its own Redis with the same users (ops/redis_acl.py), and
# tests/ops/test_redis_acl.py attacks each user on both.
#
#   RTRL_REDIS_PASSWORD_<USER>=... sh redis-acl.sh [extra redis-server arguments]
set -eu
acl="${RTRL_REDIS_ACL_FILE:-/tmp/rtrl-users.acl}"
umask 077
"""


def render() -> str:
    """compose/redis-acl.sh: each user's password from RTRL_REDIS_PASSWORD_<USER>."""
    default, *lines = acl_lines(lambda name: f">${{RTRL_REDIS_PASSWORD_{name.upper()}:?}}")
    body = [
        "{",
        "  # Off (no client logs in as it), with every permission: Redis replays its",
        "  # append-only file as this user and re-checks each transaction against it.",
        f'  echo "{default}"',
    ]
    for user, line in zip(USERS, lines, strict=True):
        body += [f"  # {why}" for why in user.why]
        body.append(f'  echo "{line}"')
    body += ['} > "$acl"', 'exec redis-server --aclfile "$acl" "$@"']
    return HEADER + "\n".join(body) + "\n"


def main() -> None:
    print(render(), end="")


if __name__ == "__main__":
    main()
