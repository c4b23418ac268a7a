"""Workers apply only weights the trainer signed (guarantee 7, the weights' half).

Anyone who can write to Redis can rewrite the registry, and anyone holding the publish
token can commit a version; neither can sign as the trainer. First the table: which
changes to a signed manifest still verify (the fields weight_sync assigns) and which
do not (everything that says what the weights are). Then the two attacks the trust
issue found, against a real weight_sync and a following worker: treatment's registry
rewritten in Redis to point at control's weights, and a version published with a
stolen publish token. The worker refuses both, keeps what it holds, counts them, and
takes the trainer's next version.
"""

from __future__ import annotations

import pytest
import redis

from rtrl import signing
from rtrl.v1 import weights_pb2
from rtrl.weight_sync import registry
from rtrl.weight_sync.client import Publisher, Subscriber
from rtrl.weight_sync.provenance import ManifestSigner, ManifestVerifier
from support import wait
from support.redis_reply import stored
from support.weight_sync import (
    MANIFEST_KEY,
    MANIFEST_PUBLIC_KEYS,
    SUBSCRIBE_TOKEN,
    Following,
    assert_bit_identical,
    publish_versions,
    train_step,
)

TREATMENT, CONTROL = "treatment", "control"


def _signed() -> weights_pb2.Manifest:
    manifest = weights_pb2.Manifest(
        arm=TREATMENT, keyframe=True, blob_size=1024, blob_checksum="0123456789abcdef", train_step=7,
        rollouts_trained=64, trained_through_event_ts_ms=1_700_000_000_000,
        tensors=[
            weights_pb2.TensorMeta(
                name="w", shape=[4, 8], dtype="float32", checksum="fedcba9876543210", encoding="full", length=128
            )
        ],
    )  # fmt: skip
    ManifestSigner(MANIFEST_KEY).sign(manifest)
    return manifest


# What weight_sync does to a manifest at commit: none of it may break the signature.
ASSIGNED = {
    "version": lambda m: setattr(m, "version", 41),
    "parent_version": lambda m: setattr(m, "parent_version", -1),
    "blob_uri": lambda m: setattr(m, "blob_uri", "file:///elsewhere/41.blob"),
    "created_ts_ms": lambda m: setattr(m, "created_ts_ms", 123),
    "traceparent": lambda m: setattr(m, "traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01"),
}
# What says which weights these are: any change must fail.
BOUND = {
    "arm": lambda m: setattr(m, "arm", CONTROL),
    "keyframe": lambda m: setattr(m, "keyframe", False),
    "blob_size": lambda m: setattr(m, "blob_size", 1025),
    "blob_checksum": lambda m: setattr(m, "blob_checksum", "0123456789abcdee"),
    "tensor checksum": lambda m: setattr(m.tensors[0], "checksum", "0" * 16),
    "tensor shape": lambda m: m.tensors[0].shape.__setitem__(0, 8),
    "tensor dtype": lambda m: setattr(m.tensors[0], "dtype", "bfloat16"),
    "tensor added": lambda m: m.tensors.add(
        name="backdoor", shape=[1], dtype="float32", checksum="0" * 16, encoding="full"
    ),
    "train_step": lambda m: setattr(m, "train_step", 8),
    "trained_through": lambda m: setattr(m, "trained_through_event_ts_ms", 1),
    "delta section": lambda m: m.delta_positions.MergeFrom(weights_pb2.Section(offset=1, length=2)),
}


@pytest.mark.parametrize("field", sorted(ASSIGNED))
def test_what_weight_sync_assigns_keeps_the_signature(field):
    manifest = _signed()
    ASSIGNED[field](manifest)
    assert ManifestVerifier(MANIFEST_PUBLIC_KEYS).problem(manifest) is None


@pytest.mark.parametrize("field", sorted(BOUND))
def test_what_the_weights_are_is_bound_by_the_signature(field):
    manifest = _signed()
    BOUND[field](manifest)
    assert ManifestVerifier(MANIFEST_PUBLIC_KEYS).problem(manifest) == "bad signature"


def test_unsigned_and_strangers_manifests_are_refused_by_name():
    verifier = ManifestVerifier(MANIFEST_PUBLIC_KEYS)
    unsigned = _signed()
    unsigned.ClearField("signature")
    assert verifier.problem(unsigned) == signing.UNSIGNED
    strangers = _signed()
    ManifestSigner(signing.generate_private_key()).sign(strangers)
    problem = verifier.problem(strangers)
    assert problem is not None and problem.startswith("signed by an unknown key")
    # A reward's signature over the same bytes is no manifest's.
    reward_signed = _signed()
    reward_signed.signature = signing.Signer(MANIFEST_KEY, signing.Purpose.REWARD).sign(b"anything")
    assert verifier.problem(reward_signed) == "bad signature"
    with pytest.raises(ValueError, match="at least one public key"):
        ManifestVerifier([])


def _commit_behind_the_servers_back(client: redis.Redis, manifest: weights_pb2.Manifest) -> None:
    """What one with write access to Redis can do: make ``manifest`` its arm's latest."""
    arm, version = manifest.arm, manifest.version
    client.set(registry.manifest_key(arm, version), manifest.SerializeToString())
    if manifest.keyframe:
        client.zadd(registry.keyframes_key(arm), {str(version): version})
    client.set(registry.latest_key(arm), version)
    client.publish(registry.published_channel(arm), str(version))


def _until_refused(subscriber: Subscriber, refusals: int) -> None:
    wait.until(
        lambda: subscriber.forged,
        f"the worker to refuse {refusals} forged versions",
        ready=lambda forged: forged >= refusals,
    )


@pytest.mark.guarantee(7)
@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_worker_applies_neither_a_rewritten_registry_nor_a_stolen_tokens_version(
    server, stack, policy_weights
):
    client = redis.Redis.from_url(stack.redis_url)
    token = stack.weight_sync_token.get_secret_value()
    trainer = {
        arm: Publisher(server.addr, token, arm, keyframe_every=20, signing_key=MANIFEST_KEY)
        for arm in (TREATMENT, CONTROL)
    }
    noise = {name: tensor.clone().normal_() for name, tensor in policy_weights.items()}
    trainer[CONTROL].publish(noise)  # control's weights: what the attacker wants treatment to serve
    versions = publish_versions(trainer[TREATMENT], policy_weights, 3)
    subscriber = Subscriber(
        server.addr,
        TREATMENT,
        "worker",
        token=SUBSCRIBE_TOKEN,
        public_keys=MANIFEST_PUBLIC_KEYS,
        max_backoff_s=0.3,
    )
    worker = Following(subscriber)
    try:
        assert [m.version for m, _ in worker.until(2)][-1] == 2

        # 1. Treatment's registry rewritten to name control's weights, signature and all.
        control_v0 = weights_pb2.Manifest.FromString(
            stored(client, registry.manifest_key(CONTROL, 0))
        )
        forged = weights_pb2.Manifest()
        forged.CopyFrom(control_v0)
        forged.arm, forged.version = TREATMENT, 3
        _commit_behind_the_servers_back(client, forged)
        _until_refused(subscriber, 1)

        # The trainer's next version goes on top of what the registry now says (a keyframe on
        # the forged v3, as after any rival publish), and the worker takes it.
        versions.append(train_step(versions[-1], 3))
        assert trainer[TREATMENT].publish(versions[-1], train_step=len(versions) - 1) == 4
        manifest, weights = worker.next()
        assert (manifest.version, manifest.keyframe) == (4, True)
        assert_bit_identical(weights, versions[-1])

        # 2. The publish token stolen: a version committed through weight_sync itself.
        refused_before = subscriber.forged
        thief = Publisher(server.addr, token, TREATMENT, signing_key=signing.generate_private_key())
        assert thief.publish(noise) == 5  # weight_sync takes it: the token is all it checks
        thief.close()
        _until_refused(subscriber, refused_before + 1)
        versions.append(train_step(versions[-1], 6))
        assert trainer[TREATMENT].publish(versions[-1], train_step=len(versions) - 1) == 6
        manifest, weights = worker.next()
        assert manifest.version == 6
        assert_bit_identical(weights, versions[-1])
        # Nothing of either forgery was ever handed to the worker.
        assert worker.nothing_pending()
    finally:
        worker.stop()
        for publisher in trainer.values():
            publisher.close()


@pytest.mark.guarantee(7)
@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_worker_refuses_an_old_version_the_trainer_signed_replayed_as_the_latest(
    server, stack, policy_weights
):
    """A rollback: one who can write Redis cannot forge a manifest, but can replay an old
    one the trainer did sign (its version number is weight_sync's, not signed). The signed
    train_step only grows within a run, so a following worker refuses a version trained to
    an earlier step than one it took, keeps what it holds, counts it, and takes the
    trainer's next version."""
    client = redis.Redis.from_url(stack.redis_url)
    trainer = Publisher(
        server.addr,
        stack.weight_sync_token.get_secret_value(),
        TREATMENT,
        keyframe_every=20,
        signing_key=MANIFEST_KEY,
    )
    versions = publish_versions(trainer, policy_weights, 4)  # v0..v3, trained to steps 0..3
    subscriber = Subscriber(
        server.addr,
        TREATMENT,
        "worker",
        token=SUBSCRIBE_TOKEN,
        public_keys=MANIFEST_PUBLIC_KEYS,
        max_backoff_s=0.3,
    )
    worker = Following(subscriber)
    try:
        assert [m.version for m, _ in worker.until(3)][-1] == 3
        # v0, the warm start, signature and blob and all, committed again as v4.
        replayed = weights_pb2.Manifest.FromString(
            stored(client, registry.manifest_key(TREATMENT, 0))
        )
        assert ManifestVerifier(MANIFEST_PUBLIC_KEYS).problem(replayed) is None
        replayed.version = 4
        _commit_behind_the_servers_back(client, replayed)
        wait.until(
            lambda: subscriber.rolled_back,
            "the worker to refuse the replayed v0",
            ready=lambda rolled_back: rolled_back >= 1,
        )
        assert subscriber.forged == 0 and worker.nothing_pending()

        # The trainer's next version (a keyframe, the registry having moved under it) is taken.
        versions.append(train_step(versions[-1], 4))
        assert trainer.publish(versions[-1], train_step=4) == 5
        manifest, weights = worker.next()
        assert (manifest.version, manifest.keyframe, manifest.train_step) == (5, True, 4)
        assert_bit_identical(weights, versions[-1])
        assert worker.nothing_pending()
    finally:
        worker.stop()
        trainer.close()
