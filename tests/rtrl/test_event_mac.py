"""The event MAC (rtrl/signing.py's MacSigner and MacVerifier): what the gateway puts on
every telemetry event and the joiner checks."""

from __future__ import annotations

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
    assert unknown is not None and unknown.startswith("signed by an unknown key")
    # The same key for another purpose makes another tag.
    other_purpose = signing.MacVerifier([key], signing.Purpose.ROLLOUT)
    assert other_purpose.problem(EVENT, headers) == "bad signature"
    # The key id names the key without giving it away.
    assert signer.key_id == signing.mac_key_id(key) and signer.key_id not in key


def test_keys_rotate_by_verifying_with_old_and_new_while_the_signer_switches():
    old, new = signing.generate_mac_key(), signing.generate_mac_key()
    verifier = signing.MacVerifier(signing.parse_mac_keys(f"{new}, {old}"), signing.Purpose.EVENT)
    for key in (old, new):
        tag = list(signing.MacSigner(key, signing.Purpose.EVENT).headers(EVENT))
        assert verifier.problem(EVENT, tag) is None


@pytest.mark.parametrize("text", ["", "  ,  ", "not-base64!", signing.generate_mac_key()[:20]])
def test_a_bad_event_key_is_refused_by_name(text):
    with pytest.raises(ValueError, match="key"):
        signing.MacVerifier(signing.parse_mac_keys(text), signing.Purpose.EVENT)
