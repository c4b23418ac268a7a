"""Ed25519 signatures on the records that steer training.

Kafka and Redis cannot be trusted to say who wrote a record (the embedded broker has
no ACLs at all), so the service that produces a record signs it and the one that
consumes it verifies it: the joiner signs every reward, the trainer trains only on
rewards that verify. The producer holds the private key; the consumer holds only
public keys, so a consumer (or anyone who reads its environment) cannot forge.

A signature covers ``b"rtrl/v1/<purpose>\\0" + the record's exact bytes``: a reward's
signature is no rollout's or manifest's. It travels in the record's Kafka headers with
the signer's key id (the first 16 hex digits of SHA-256 over its public key), so keys
rotate by adding the new public key to the verifiers, then switching the signer.

Where one writer and one reader already trust each other with what the record says, a
signature buys nothing a shared key does not, and costs fifty times more: an HMAC-SHA256
(``MacSigner``/``MacVerifier``, ~3 µs a record against Ed25519's ~40 µs to sign and ~110 µs
to verify). A MAC key is pairwise: one writer, one reader, so whoever holds it can forge
only to itself. Telemetry events carry one MAC for the joiner (which turns them into
rewards and could write any reward anyway) and one for the analytics sink (which writes
its own tables anyway); rollouts carry a MAC for the joiner (which re-emits every rollout
it joins inside a reward it signs) beside their signature. MACs travel in ``rtrl-mac``
headers, as many as a record has readers, each the key's id and the tag.

Keys are base64url text: ``python -m rtrl.signing`` prints a new pair and an event key.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import hmac
import secrets
from collections.abc import Iterable, Sequence
from typing import Protocol

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

UNSIGNED = "unsigned"
"""Verifier.problem for a record that carries no signature at all."""
SIGNATURE_HEADER = "rtrl-sig"
SIGNER_HEADER = "rtrl-signer"
MAC_HEADER = "rtrl-mac"
"""One reader's MAC: its key's id (16 hex digits) then the 32-byte tag; repeated per reader."""
_KEY_ID_LENGTH = 16


class Purpose(enum.StrEnum):
    REWARD = "reward"
    MANIFEST = "manifest"
    ROLLOUT = "rollout"
    API_KEY = "api-key"
    EVENT = "event"
    TRAINER_STEP = "trainer-step"
    REWARD_LATE = "reward-late"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    text = text.strip()
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def generate_private_key() -> str:
    return _b64(Ed25519PrivateKey.generate().private_bytes_raw())


def public_key_of(private_key: str) -> str:
    return _b64(_private(private_key).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))


def key_id(public_key: str) -> str:
    return hashlib.sha256(_unb64(public_key)).hexdigest()[:16]


def _raw_key(text: str, kind: str) -> bytes:
    try:
        raw = _unb64(text)
    except ValueError as exc:
        raise ValueError(f"not {kind} key (32 bytes, base64url): {exc}") from None
    if len(raw) != 32:
        raise ValueError(f"not {kind} key (32 bytes, base64url): {len(raw)} bytes")
    return raw


def _private(text: str) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(_raw_key(text, "an Ed25519 private"))


def _public(text: str) -> Ed25519PublicKey:
    return Ed25519PublicKey.from_public_bytes(_raw_key(text, "an Ed25519 public"))


def check_private_key(text: str) -> None:
    """Raises ValueError, saying why, unless ``text`` is an Ed25519 private key."""
    _private(text)


def _domain(purpose: Purpose) -> bytes:
    """What every authenticated message of ``purpose`` starts with."""
    return b"rtrl/v1/" + purpose.value.encode() + b"\0"


def _message(purpose: Purpose, payload: bytes) -> bytes:
    return _domain(purpose) + payload


class Signer:
    def __init__(self, private_key: str, purpose: Purpose) -> None:
        self._key = _private(private_key)
        self.purpose = purpose
        self.key_id = key_id(public_key_of(private_key))
        self._signer_header = (SIGNER_HEADER, self.key_id.encode())

    def sign(self, payload: bytes) -> bytes:
        return self._key.sign(_message(self.purpose, payload))

    def headers(self, payload: bytes) -> tuple[tuple[str, bytes], tuple[str, bytes]]:
        """The Kafka headers that carry the signature of ``payload``."""
        return (SIGNATURE_HEADER, self.sign(payload)), self._signer_header


class Verifier:
    """Checks records against a set of public keys (more than one while keys rotate)."""

    def __init__(self, public_keys: Iterable[str], purpose: Purpose) -> None:
        self._keys = {key_id(k): _public(k) for k in public_keys if k.strip()}
        if not self._keys:
            raise ValueError(f"a {purpose} verifier needs at least one public key")
        self.purpose = purpose

    def problem(self, payload: bytes, headers: Sequence[tuple[str, bytes]] | None) -> str | None:
        """None if ``payload`` carries a valid signature by one of the keys; else why not."""
        found = dict(headers or ())
        signer = found.get(SIGNER_HEADER)
        return self.signature_problem(
            payload,
            found.get(SIGNATURE_HEADER),
            None if signer is None else signer.decode(errors="replace"),
        )

    def signature_problem(
        self, payload: bytes, signature: bytes | None, signer: str | None
    ) -> str | None:
        """As problem(), for a signature and key id carried elsewhere than in Kafka headers."""
        if not signature or not signer:
            return UNSIGNED
        key = self._keys.get(signer)
        if key is None:
            return f"signed by an unknown key {signer[:32]!r}"
        try:
            key.verify(signature, _message(self.purpose, payload))
        except InvalidSignature:
            return "bad signature"
        return None


def generate_mac_key() -> str:
    return _b64(secrets.token_bytes(32))


def mac_key_id(key: str) -> str:
    """A MAC key's name in headers: one-way, so naming it gives nothing of it away."""
    return hashlib.sha256(b"rtrl/v1/mac-key-id\0" + _raw_key(key, "a MAC")).hexdigest()[:16]


class MacSigner:
    """HMAC-SHA256 over ``_message(purpose, payload)`` under one reader's key, for records
    whose writer and reader both hold it (events: the gateway and the joiner)."""

    def __init__(self, key: str, purpose: Purpose) -> None:
        self._key = _raw_key(key, "a MAC")
        self.purpose = purpose
        self.key_id = mac_key_id(key)
        self._prefix = self.key_id.encode()
        self._keyed = _keyed(self._key, purpose)

    def sign(self, payload: bytes) -> bytes:
        return _tag(self._keyed, payload)

    def headers(self, payload: bytes) -> tuple[tuple[str, bytes], ...]:
        """The Kafka header that carries the MAC of ``payload``."""
        return ((MAC_HEADER, self._prefix + _tag(self._keyed, payload)),)


def _keyed(key: bytes, purpose: Purpose) -> hmac.HMAC:
    """HMAC-SHA256 under ``key`` with the purpose's domain already absorbed, to copy per
    record: the MAC of _message(purpose, payload) without keying HMAC again each time (a
    quarter of a 1 KB record's MAC; this runs per record on the hot paths)."""
    return hmac.new(key, _domain(purpose), "sha256")


def _tag(keyed: hmac.HMAC, payload: bytes) -> bytes:
    mac = keyed.copy()
    mac.update(payload)
    return mac.digest()


class HeaderSigner(Protocol):
    """Anything that authenticates a record through its Kafka headers."""

    def headers(self, payload: bytes) -> tuple[tuple[str, bytes], ...]: ...


class Seal:
    """Several authenticators on one record: a signature, a MAC per reader."""

    def __init__(self, *signers: HeaderSigner) -> None:
        if not signers:
            raise ValueError("a seal needs at least one signer")
        self._signers = signers

    def headers(self, payload: bytes) -> tuple[tuple[str, bytes], ...]:
        found: tuple[tuple[str, bytes], ...] = ()
        for signer in self._signers:
            found += signer.headers(payload)
        return found


class MacVerifier:
    """Checks a record's MAC under one of this reader's keys (more than one while keys
    rotate); the MACs a record carries for other readers are ignored."""

    def __init__(self, keys: Iterable[str], purpose: Purpose) -> None:
        self._keys = {
            mac_key_id(k): _keyed(_raw_key(k, "a MAC"), purpose) for k in keys if k.strip()
        }
        if not self._keys:
            raise ValueError(f"a {purpose} verifier needs at least one key")
        self.purpose = purpose

    def problem(self, payload: bytes, headers: Sequence[tuple[str, bytes]] | None) -> str | None:
        """None if ``payload`` carries a valid MAC under one of the keys; else why not."""
        carried = 0
        for name, value in headers or ():
            if name != MAC_HEADER:
                continue
            carried += 1
            key = self._keys.get(value[:_KEY_ID_LENGTH].decode(errors="replace"))
            if key is not None:
                return self._check(key, payload, value[_KEY_ID_LENGTH:])
        if carried:
            return f"no MAC under this reader's key ({carried} for other readers or unknown keys)"
        return self._legacy(payload, dict(headers or ()))

    def _check(self, key: hmac.HMAC, payload: bytes, tag: bytes) -> str | None:
        return None if hmac.compare_digest(_tag(key, payload), tag) else "bad signature"

    def _legacy(self, payload: bytes, found: dict[str, bytes]) -> str | None:
        """A record written before MACs had their own header (in rtrl-sig, its key id in
        rtrl-signer), still in a topic after an upgrade."""
        tag, signer = found.get(SIGNATURE_HEADER), found.get(SIGNER_HEADER)
        if not tag or not signer:
            return UNSIGNED
        key = self._keys.get(signer.decode(errors="replace"))
        if key is None:
            return f"signed by an unknown key {signer[:32].decode(errors='replace')!r}"
        return self._check(key, payload, tag)


def check_mac_key(text: str) -> None:
    """Raises ValueError, saying why, unless ``text`` is one MAC key."""
    _raw_key(text, "a MAC")


def parse_mac_keys(text: str) -> list[str]:
    """A comma-separated list of MAC keys, each checked (the first signs)."""
    keys = [k.strip() for k in text.split(",") if k.strip()]
    for k in keys:
        _raw_key(k, "a MAC")
    return keys


def parse_public_keys(text: str) -> list[str]:
    """A comma-separated list of public keys, each checked."""
    keys = [k.strip() for k in text.split(",") if k.strip()]
    for k in keys:
        _public(k)
    return keys


def main() -> None:
    private = generate_private_key()
    print(f"private (the signer's alone): {private}")
    print(f"public (for the verifiers):   {public_key_of(private)}")
    print(f"MAC key (one writer and one reader, e.g. gateway and joiner): {generate_mac_key()}")


if __name__ == "__main__":
    main()
