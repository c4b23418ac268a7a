"""The stack's Redis gives each service a user of its own (ops/redis_acl.py), and each
user reaches only the keys its service uses (issue 17: one HSET minted an API key,
rewriting a manifest pointed treatment at control's weights, with no credential at all;
issue 24: `rtrl up`'s own Redis took any local client).

Both stacks' Redis run here, each a real redis-server: compose's, started by its script
(compose/redis-acl.sh), and the embedded one, started as `rtrl up` starts it
(redis_acl.start, passwords from a state directory's secrets). On each, every service's
own code paths work as its user (the gateway's claim script and writes, the serving
API's key, rate and binding work, weight_sync's registry, pub/sub and a subscriber,
every heartbeat); then each user, and a client with no password, attacks what belongs to
another and is refused."""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from rtrl import heartbeat, kafka, procs, signing
from rtrl.api_keys import (
    COMPLETIONS,
    PRIVATE_USERS,
    SERVED_PREFIX,
    KeyCache,
    KeyVerifier,
    RateLimiter,
    issue_key,
)
from rtrl.ingest.gateway import ACCEPTED, Gateway
from rtrl.weight_sync import registry
from rtrl.weight_sync.client import Publisher, Subscriber
from rtrl.weight_sync.config import WeightSyncSettings
from rtrl_client.client import make_event
from rtrl_client.v1 import telemetry_pb2
from support import wait
from support.signing import EVENT_SIGNER, KEY_AUTHORITY
from support.weight_sync import (
    ARM,
    MANIFEST_KEY,
    MANIFEST_PUBLIC_KEYS,
    SUBSCRIBE_TOKEN,
    Following,
    InProcessServer,
)

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "compose" / "redis-acl.sh"
USERS = ("operator", "ingest", "inference", "weight_sync", "trainer", "reward_stream", "analytics")


@pytest.fixture(scope="module", params=["compose", "embedded"])
def acl_redis(request, tmp_path_factory):
    """name -> redis URL of that user, on compose's Redis or on the embedded stack's."""
    where = tmp_path_factory.mktemp(f"redis-acl-{request.param}")
    passwords = _passwords(request.param, where)
    proc, acl_file = _start(request.param, where, passwords)
    assert acl_file.stat().st_mode & 0o077 == 0, "the ACL file proves every password: owner-only"
    yield {
        user: f"redis://{user}:{password}@127.0.0.1:{proc.port}/0"
        for user, password in passwords.items()
    } | {"anonymous": f"redis://127.0.0.1:{proc.port}/0"}
    proc.stop()


def _passwords(kind: str, where: Path) -> dict[str, str]:
    """Compose's come from the operator's environment (random here); `rtrl up`'s from the
    state directory's secrets."""
    if kind == "compose":
        return {user: secrets.token_urlsafe(16) for user in USERS}
    from rtrl.ops import stack_secrets

    passwords = stack_secrets.ensure(where).redis_passwords()
    assert set(passwords) == set(USERS)
    return passwords


def _start(kind: str, where: Path, passwords: dict[str, str]) -> tuple[procs.Proc, Path]:
    """A durable Redis in ``where``, started as its stack starts it; and its ACL file."""
    if kind == "embedded":
        from rtrl.ops import redis_acl

        return redis_acl.start(where, passwords, where / "logs" / "redis.log"), where / (
            redis_acl.ACL_FILE
        )
    env = {f"RTRL_REDIS_PASSWORD_{user.upper()}": password for user, password in passwords.items()}
    env["RTRL_REDIS_ACL_FILE"] = str(where / "users.acl")
    port = procs.free_port()
    # compose.yaml's command, on a free port in ``where``.
    argv = ["sh", str(SCRIPT), "--appendonly", "yes", "--appendfsync", "everysec"]
    argv += ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(where)]
    proc = procs.spawn("redis-acl", argv, where / "redis.log", env=env, port=port)
    procs.wait_for_port(port)
    return proc, where / "users.acl"


def refused(url: str, *command) -> bool:
    client = redis.Redis.from_url(url)
    try:
        client.execute_command(*command)
    except (redis.exceptions.NoPermissionError, redis.exceptions.AuthenticationError):
        return True
    except redis.exceptions.ResponseError as exc:
        return "NOPERM" in str(exc) or "NOAUTH" in str(exc)
    finally:
        client.close()
    return False


def test_each_service_does_its_work_as_its_own_user(
    acl_redis, stack, stack_settings, policy_weights
):
    async def work() -> None:
        operator = aioredis.Redis.from_url(acl_redis["operator"])
        key = await issue_key(
            operator,
            KEY_AUTHORITY,
            "editor",
            scopes={"*", COMPLETIONS},
            rate_per_s=100.0,
            burst=100.0,
        )
        await operator.sadd(PRIVATE_USERS, "someone-private")
        verifier = KeyVerifier(signing.parse_public_keys(os.environ["RTRL_API_KEY_PUBLIC_KEYS"]))

        # The serving API: the key, its rate, the private users, the binding, an applied version.
        inference = aioredis.Redis.from_url(acl_redis["inference"])
        api_key = await KeyCache(inference, 1.0, verifier).lookup(key)
        assert api_key is not None and api_key.client_id == "editor"
        assert await RateLimiter(inference).take(api_key, 1) == 0.0
        assert await inference.sismember(PRIVATE_USERS, "someone-private")
        await inference.set(SERVED_PREFIX + "r-acl", "editor", ex=60)
        await inference.hset("rtrl:applied:treatment:0", "inference-0", 1)

        # The gateway: the same key, then a batch through its claim script and writes.
        ingest = aioredis.Redis.from_url(acl_redis["ingest"])
        assert await KeyCache(ingest, 1.0, verifier).lookup(key) == api_key
        producer = kafka.AsyncProducer(stack_settings)
        try:
            gateway = Gateway(
                producer,
                ingest,
                dedup_ttl_s=60,
                claim_ttl_s=30,
                max_inflight=100,
                signer=EVENT_SIGNER,
            )
            event = make_event(
                "r-acl",
                "s",
                "u",
                edit_shown=telemetry_pb2.EditShown(file_path="a.py", edit_text="x = 1\n"),
            )
            private = make_event(
                "r-acl",
                "s",
                "someone-private",
                edit_shown=telemetry_pb2.EditShown(file_path="a.py", edit_text="y\n"),
            )
            results = await gateway.publish([event, private], key=api_key)
            assert [r.status for r in results] == [
                ACCEPTED,
                ACCEPTED,
            ] and gateway.counters.privacy == 1
        finally:
            await asyncio.to_thread(producer.close)

        # Every service beats, and reads the others' beats (its health check does).
        for user in ("ingest", "inference", "weight_sync", "trainer", "reward_stream", "analytics"):
            client = aioredis.Redis.from_url(acl_redis[user])
            await heartbeat.beat(client, user, "0", heartbeat.BEATS[user]())
            await client.aclose()
        for client in (operator, inference, ingest):
            await client.aclose()

    asyncio.run(work())
    beats = heartbeat.read(redis.Redis.from_url(acl_redis["trainer"]))
    assert {hb.service for hb in beats} >= {
        "ingest",
        "inference",
        "weight_sync",
        "trainer",
        "reward_stream",
        "analytics",
    }

    # weight_sync: the registry (transactions, the marker, pub/sub) and a subscriber, as its user.
    settings = WeightSyncSettings(port=procs.free_port(), poll_interval_s=0.2)
    server = InProcessServer(
        settings, stack.model_copy(update={"redis_url": acl_redis["weight_sync"]})
    )
    server.start()
    publisher = Publisher(
        server.addr, stack.weight_sync_token.get_secret_value(), ARM, signing_key=MANIFEST_KEY
    )
    following = Following(
        Subscriber(
            server.addr, ARM, "worker-acl", token=SUBSCRIBE_TOKEN, public_keys=MANIFEST_PUBLIC_KEYS
        )
    )
    try:
        assert publisher.publish(policy_weights) == 0
        assert following.next()[0].version == 0
        # Its background loops (the pub/sub listener, beats, the registry watch) still run.
        assert not [task for task in server.running.tasks if task.done()]
    finally:
        following.stop()
        publisher.close()
        server.close()


def test_weight_sync_hears_every_publish_as_its_own_user(acl_redis):
    """weight_sync's listener subscribes to the pattern of every arm's channel, and Redis
    matches a pattern subscription literally against the user's channel rules: a rule that
    only glob-matches the pattern refuses it, and the server stops."""
    client = redis.Redis.from_url(acl_redis["weight_sync"])
    pubsub = client.pubsub()
    try:
        pubsub.psubscribe(registry.PUBLISHED_PATTERN)
        subscribed = pubsub.get_message(timeout=5)
        assert subscribed is not None and subscribed["type"] == "psubscribe"
        client.publish(registry.published_channel("treatment"), "7")
        message = wait.until(lambda: pubsub.get_message(timeout=1), "the publish", timeout_s=10)
        assert message["channel"] == registry.published_channel("treatment").encode()
        assert message["data"] == b"7"
    finally:
        pubsub.close()
        client.close()


# (user, command): what each user must never do. Each line is an attack the trust issue
# found or one like it: minting or widening an API key, rewriting the weight registry,
# binding a rollout to another client, registering users private, wiping everything.
ATTACKS = [
    ("anonymous", ("GET", "rtrl:ws:treatment:latest")),
    ("anonymous", ("DEL", "rtrl:ws:treatment:latest")),
    ("anonymous", ("HSET", "rtrl:ingest:key:minted", "client_id", "attacker")),
    ("anonymous", ("KEYS", "*")),
    ("anonymous", ("CONFIG", "GET", "*")),
    ("ingest", ("HSET", "rtrl:ingest:key:minted", "client_id", "attacker")),
    ("ingest", ("SET", "rtrl:ws:treatment:latest", "0")),
    ("ingest", ("SET", SERVED_PREFIX + "r-acl", "attacker")),
    ("inference", ("SREM", PRIVATE_USERS, "someone-private")),
    ("ingest", ("FLUSHALL",)),
    ("ingest", ("KEYS", "*")),
    ("inference", ("HSET", "rtrl:ingest:key:minted", "scopes", "*")),
    ("inference", ("SET", "rtrl:ws:treatment:manifest:0", "forged")),
    ("inference", ("GET", SERVED_PREFIX + "r-acl")),
    ("inference", ("SET", "rtrl:ingest:event:e1", "done")),
    ("inference", ("CONFIG", "SET", "requirepass", "x")),
    ("weight_sync", ("HSET", "rtrl:ingest:key:minted", "client_id", "attacker")),
    ("weight_sync", ("SET", SERVED_PREFIX + "r-acl", "attacker")),
    ("trainer", ("SET", "rtrl:ws:treatment:latest", "0")),
    ("trainer", ("PUBLISH", "rtrl:ws:treatment:published", "9")),
    ("reward_stream", ("HSET", "rtrl:ingest:key:minted", "client_id", "attacker")),
    ("analytics", ("DEL", "rtrl:ws:registry")),
    ("analytics", ("GET", "rtrl:ingest:key:anything")),
]


@pytest.mark.guarantee(7)
@pytest.mark.parametrize(
    "user, command", ATTACKS, ids=[f"{u}: {' '.join(c[:2])}" for u, c in ATTACKS]
)
def test_no_user_reaches_what_another_service_owns(acl_redis, user, command):
    assert refused(acl_redis[user], *command), f"{user} may {' '.join(command)}"


def test_the_refusals_are_not_a_broken_server(acl_redis):
    """The same commands succeed for the operator, so a refusal above is the ACL's."""
    for _, command in ATTACKS:
        if command[0] not in ("FLUSHALL", "CONFIG"):
            assert not refused(acl_redis["operator"], *command), command


@pytest.mark.parametrize("kind", ["compose", "embedded"])
def test_transactions_outlive_a_restart(tmp_path, kind):
    """Both stacks' Redis keep an append-only file and replay it when they start again
    (`rtrl down` then `up`, a compose restart), the transactions in it too: the registry's
    and the key records' writes. Redis replays them as its default user
    (redis_acl.DEFAULT_USER says why that user, off, holds every permission)."""
    passwords = _passwords(kind, tmp_path)
    proc, _ = _start(kind, tmp_path, passwords)
    try:
        operator = redis.Redis.from_url(
            f"redis://operator:{passwords['operator']}@127.0.0.1:{proc.port}/0"
        )
        with operator.pipeline(transaction=True) as pipe:
            pipe.set("rtrl:ws:treatment:latest", "3")
            pipe.hset("rtrl:ingest:key:k", "client_id", "c")
            pipe.execute()
        operator.set("rtrl:hb:plain", "1")
        operator.close()
    finally:
        proc.stop()
    proc, _ = _start(kind, tmp_path, passwords)
    try:
        operator = redis.Redis.from_url(
            f"redis://operator:{passwords['operator']}@127.0.0.1:{proc.port}/0"
        )
        assert operator.get("rtrl:hb:plain") == b"1"
        assert operator.get("rtrl:ws:treatment:latest") == b"3", "the transaction was lost"
        assert operator.hget("rtrl:ingest:key:k", "client_id") == b"c"
        operator.close()
    finally:
        proc.stop()


@pytest.mark.guarantee(7)
@pytest.mark.parametrize("writer", [u for u in USERS if u != "operator"])
def test_each_service_writes_only_its_own_heartbeats(acl_redis, writer):
    """L1: every service's user could write every heartbeat (a forged joiner beat hid the
    reward-hacking alerts from `rtrl status`). Now each writes rtrl:hb:<its own name>:* only."""
    for owner in heartbeat.BEATS:
        key = heartbeat.key(owner, "forged")
        if owner == writer:
            assert not refused(acl_redis[writer], "SET", key, "{}", "EX", "10"), key
        else:
            assert refused(acl_redis[writer], "SET", key, "{}", "EX", "10"), f"{writer} wrote {key}"
