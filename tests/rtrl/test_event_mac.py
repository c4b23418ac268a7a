"""MACs (rtrl/signing.py's MacSigner, Seal and MacVerifier): what the gateway puts on every
telemetry event for each of its readers, the workers on every rollout for the joiner, the
joiner on every reward for the trainer and the sink."""

from __future__ import annotations

import base64
import hashlib
import hmac

import pytest

from rtrl import signing

EVENT = b"\x0a\x05event bytes"


def test_a_mac_verifies_under_its_key_and_purpose_and_nothing_else():
    key = signing.generate_mac_key()
    signer = signing.MacSigner(key, signing.Purpose.EVENT)
    verifier = signing.MacVerifier([key], signing.Purpose.EVENT)
    headers = list(signer.headers(EVENT))
    assert verifier.problem(EVENT, headers) is None
    assert verifier.problem(EVENT + b"!", headers) == "bad signature"
    assert verifier.problem(EVENT, []) == verifier.problem(EVENT, None) == signing.UNSIGNED
    stranger = signing.MacSigner(signing.generate_mac_key(), signing.Purpose.EVENT)
    unknown = verifier.problem(EVENT, list(stranger.headers(EVENT)))
    assert unknown is not None and unknown.startswith("no MAC under this reader's key")
    # The same key for another purpose makes another tag.
    other_purpose = signing.MacVerifier([key], signing.Purpose.ROLLOUT)
    assert other_purpose.problem(EVENT, headers) == "bad signature"
    # The key id names the key without giving it away.
    assert signer.key_id == signing.mac_key_id(key) and signer.key_id not in key


def test_the_tag_is_hmac_sha256_of_the_purpose_domain_and_the_payload():
    """The wire format, spelled out: whoever reimplements a reader computes exactly this
    (the signer keys HMAC once and copies it per record; the tags must not change)."""
    key = signing.generate_mac_key()
    raw = base64.urlsafe_b64decode(key + "=" * (-len(key) % 4))
    expected = hmac.new(raw, b"rtrl/v1/event\0" + EVENT, hashlib.sha256).digest()
    signer = signing.MacSigner(key, signing.Purpose.EVENT)
    assert signer.sign(EVENT) == expected
    assert list(signer.headers(EVENT)) == [(signing.MAC_HEADER, signer.key_id.encode() + expected)]
    assert signer.sign(EVENT) == expected  # the keyed state is copied, never consumed


def test_each_reader_checks_its_own_mac_and_ignores_the_others():
    joiner, sink = signing.generate_mac_key(), signing.generate_mac_key()
    seal = signing.Seal(
        signing.MacSigner(joiner, signing.Purpose.EVENT),
        signing.MacSigner(sink, signing.Purpose.EVENT),
    )
    headers = list(seal.headers(EVENT))
    assert [name for name, _ in headers] == [signing.MAC_HEADER, signing.MAC_HEADER]
    for key in (joiner, sink):
        assert signing.MacVerifier([key], signing.Purpose.EVENT).problem(EVENT, headers) is None
    # The sink's MAC alone is nothing the joiner takes, and a tag moved under the joiner's
    # key id is a bad one.
    for_the_sink = [headers[1]]
    checked_by_joiner = signing.MacVerifier([joiner], signing.Purpose.EVENT)
    refused = checked_by_joiner.problem(EVENT, for_the_sink)
    assert refused is not None and refused.startswith("no MAC under this reader")
    moved = [(signing.MAC_HEADER, headers[0][1][:16] + headers[1][1][16:])]
    assert checked_by_joiner.problem(EVENT, moved) == "bad signature"


def test_a_mac_written_before_macs_had_their_own_header_still_verifies():
    # rtrl-sig holds the tag and rtrl-signer the key id: what a gateway wrote before the
    # upgrade, still in a topic after it.
    key = signing.generate_mac_key()
    tag = signing.MacSigner(key, signing.Purpose.EVENT).sign(EVENT)
    legacy = [
        (signing.SIGNATURE_HEADER, tag),
        (signing.SIGNER_HEADER, signing.mac_key_id(key).encode()),
    ]
    verifier = signing.MacVerifier([key], signing.Purpose.EVENT)
    assert verifier.problem(EVENT, legacy) is None
    assert verifier.problem(EVENT + b"!", legacy) == "bad signature"


def test_keys_rotate_by_verifying_with_old_and_new_while_the_signer_switches():
    old, new = signing.generate_mac_key(), signing.generate_mac_key()
    verifier = signing.MacVerifier(signing.parse_mac_keys(f"{new}, {old}"), signing.Purpose.EVENT)
    for key in (old, new):
        tag = list(signing.MacSigner(key, signing.Purpose.EVENT).headers(EVENT))
        assert verifier.problem(EVENT, tag) is None


@pytest.mark.parametrize(
    "text",
    # A fixed id for the random key: every pytest worker must collect the same test names.
    ["", "  ,  ", "not-base64!", pytest.param(signing.generate_mac_key()[:20], id="too-short")],
)
def test_a_bad_event_key_is_refused_by_name(text):
    with pytest.raises(ValueError, match="key"):
        signing.MacVerifier(signing.parse_mac_keys(text), signing.Purpose.EVENT)
