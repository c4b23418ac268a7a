"""Who must have written each record the joiner reads, checked before anything decodes it.

Rollout records are signed by the inference workers (Ed25519; the joiner holds only their
public keys) and telemetry events are authenticated by the ingest gateway (HMAC-SHA256
under the event key the gateway and the joiner share; rtrl/signing.py says why). A record
that fails is never joined: the live joiner dead-letters it with the reason, a replay
skips it. So nothing that merely reaches the broker (the embedded one has no ACLs) can
put a rollout, or a user's signal about one, into a reward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rtrl import signing, topics

if TYPE_CHECKING:
    from rtrl.reward_stream.config import RewardStreamSettings


@dataclass(frozen=True)
class Authenticator:
    rollouts: signing.Verifier
    """The inference workers' public keys."""
    events: signing.MacVerifier
    """The gateway's event key(s)."""

    def problem(
        self, topic: str, value: bytes, headers: Sequence[tuple[str, bytes]] | None
    ) -> str | None:
        """None if the record's writer is who must write ``topic``; else why not."""
        if topic == topics.ROLLOUT:
            problem = self.rollouts.problem(value, headers)
            return problem and f"rollout not signed by an inference worker: {problem}"
        problem = self.events.problem(value, headers)
        return problem and f"event not authenticated by the ingest gateway: {problem}"

    @classmethod
    def of(cls, settings: RewardStreamSettings, who: str) -> Authenticator:
        """From the settings; ``who`` (the joiner, a replay) names the refuser of missing keys."""
        rollout_keys = settings.rollout_public_keys
        event_keys = settings.event_keys.get_secret_value()
        if not rollout_keys.strip():
            raise SystemExit(
                f"RTRL_REWARD_ROLLOUT_PUBLIC_KEYS is not set: {who} joins only rollouts "
                "an inference worker signed"
            )
        if not event_keys.strip():
            raise SystemExit(
                f"RTRL_REWARD_EVENT_KEYS is not set: {who} joins only events the ingest "
                "gateway authenticated (rtrl up generates the key; python -m rtrl.signing prints one)"
            )
        try:
            return cls(
                signing.Verifier(signing.parse_public_keys(rollout_keys), signing.Purpose.ROLLOUT),
                signing.MacVerifier(signing.parse_mac_keys(event_keys), signing.Purpose.EVENT),
            )
        except ValueError as exc:
            raise SystemExit(f"the joiner's keys: {exc}") from None
