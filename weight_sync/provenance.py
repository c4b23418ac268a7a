"""Who made a weight version: the trainer signs each manifest, every worker verifies it.

Redis and the blob store say nothing about who wrote a manifest (anyone who can reach
Redis can rewrite one), so a worker trusts a version only if its manifest carries the
trainer's Ed25519 signature (rtrl/signing.py, purpose "manifest"). The signature covers
the manifest as the trainer wrote it, with the fields weight_sync assigns at commit
cleared (SERVER_ASSIGNED): the arm, the blob's size and checksum, and every tensor's
name, shape, dtype and checksum are bound, so a manifest pointed at another arm's blob,
or at tensors the trainer never published, fails before anything is decoded.
"""

from __future__ import annotations

from collections.abc import Iterable

from rtrl import signing
from rtrl.v1 import weights_pb2

SERVER_ASSIGNED = (
    "version",
    "parent_version",
    "blob_uri",
    "created_ts_ms",
    "traceparent",
    "signature",
    "signer",
)


def claim(manifest: weights_pb2.Manifest) -> bytes:
    """The bytes the trainer signs: the manifest without what weight_sync assigns."""
    signed = weights_pb2.Manifest()
    signed.CopyFrom(manifest)
    for field in SERVER_ASSIGNED:
        signed.ClearField(field)
    return signed.SerializeToString(deterministic=True)


class ManifestSigner:
    """The trainer's half."""

    def __init__(self, private_key: str) -> None:
        self._signer = signing.Signer(private_key, signing.Purpose.MANIFEST)
        self.public_key = signing.public_key_of(private_key)

    def sign(self, manifest: weights_pb2.Manifest) -> None:
        manifest.signature = self._signer.sign(claim(manifest))
        manifest.signer = self._signer.key_id


class ManifestVerifier:
    """The workers' half: public keys only (more than one while keys rotate)."""

    def __init__(self, public_keys: Iterable[str]) -> None:
        self._verifier = signing.Verifier(public_keys, signing.Purpose.MANIFEST)

    def problem(self, manifest: weights_pb2.Manifest) -> str | None:
        """None if the trainer signed this manifest; else why it must not be applied."""
        return self._verifier.signature_problem(
            claim(manifest), manifest.signature, manifest.signer
        )
