"""Compose's Redis gives each service a user of its own (compose/redis-acl.sh), and each
user reaches only the keys its service uses (issue 17: one HSET minted an API key,
rewriting a manifest pointed treatment at control's weights, with no credential at all).

The script runs here against a real redis-server. Each service's own code paths work as
its user (the gateway's claim script and writes, the serving API's key, rate and
binding work, weight_sync's registry, pub/sub and a subscriber, every heartbeat); then
each user attacks what belongs to another and is refused."""

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
from rtrl.ingest.client import make_event
from rtrl.ingest.gateway import ACCEPTED, Gateway
from rtrl.v1 import telemetry_pb2
from rtrl.weight_sync.client import Publisher, Subscriber
from rtrl.weight_sync.config import WeightSyncSettings
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


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory):
    """name -> redis URL of that user, on a redis-server started by compose's own script."""
    where = tmp_path_factory.mktemp("redis-acl")
    passwords = {user: secrets.token_urlsafe(16) for user in USERS}
    env = {f"RTRL_REDIS_PASSWORD_{user.upper()}": password for user, password in passwords.items()}
    env["RTRL_REDIS_ACL_FILE"] = str(where / "users.acl")
    port = procs.free_port()
    argv = [
        "sh",
        str(SCRIPT),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--dir",
        str(where),
        "--daemonize",
        "no",
    ]
    proc = procs.spawn("redis-acl", argv, where / "redis.log", env=env, port=port)
    procs.wait_for_port(port)
    assert (where / "users.acl").stat().st_mode & 0o077 == 0, (
        "the ACL file holds every password: owner-only"
    )
    yield {
        user: f"redis://{user}:{password}@127.0.0.1:{port}/0"
        for user, password in passwords.items()
    } | {"anonymous": f"redis://127.0.0.1:{port}/0"}
    proc.stop()


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
    finally:
        following.stop()
        publisher.close()
        server.close()


# (user, command): what each user must never do. Each line is an attack the trust issue
# found or one like it: minting or widening an API key, rewriting the weight registry,
# binding a rollout to another client, registering users private, wiping everything.
ATTACKS = [
    ("anonymous", ("GET", "rtrl:ws:treatment:latest")),
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
