"""Who must have written each record the joiner reads, checked before anything decodes it.

Rollout records carry a MAC from the inference workers and telemetry events one from the
ingest gateway (HMAC-SHA256, each under a key its writer shares with the joiner alone;
rtrl/signing.py says why a MAC is enough where a signature costs fifty times more). A record
that fails is never joined: the live joiner dead-letters it with the reason, a replay
skips it. So nothing that merely reaches the broker (the embedded one has no ACLs) can
put a rollout, or a user's signal about one, into a reward.

The topics are an allow-list: each one the join reads names its writer, and a record from
any other topic is refused as having no known writer, never checked against a default.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

from rtrl import signing, topics
from rtrl.authn import TopicWriters, Writer

if TYPE_CHECKING:
    from rtrl.reward_stream.config import RewardStreamSettings


class Authenticator(TopicWriters):
    reader = "the joiner"

    @classmethod
    def of(cls, settings: RewardStreamSettings) -> Authenticator:
        """From the settings' keys; a ValueError if either set is empty (``python -m`` refuses
        that first, naming the variable: RewardStreamSettings.required_secrets)."""
        workers = Writer(
            signing.MacVerifier(
                signing.parse_mac_keys(settings.rollout_mac_keys.get_secret_value()),
                signing.Purpose.ROLLOUT,
            ),
            "rollout not signed by an inference worker",
        )
        gateway = Writer(
            signing.MacVerifier(
                signing.parse_mac_keys(settings.event_keys.get_secret_value()),
                signing.Purpose.EVENT,
            ),
            "event not authenticated by the ingest gateway",
        )
        return cls(
            MappingProxyType(
                {
                    topics.ROLLOUT: workers,
                    topics.EDIT: gateway,
                    topics.PERSISTENCE: gateway,
                    topics.FOLLOWUP: gateway,
                }
            )
        )
