"""Who must have written each record the analytics sink stores, checked before it is decoded.

The sink's tables are what the A/B report, the status view and the training report read,
so a record is stored only if its writer vouched for it, as the consumers on the signed
path check theirs: a rollout carries an inference worker's Ed25519 signature (the joiner,
which re-emits it inside a reward, checks a MAC instead), a trainer step the trainer's
signature, with the key it signs weight manifests with. Rewards, late records and
telemetry events carry an HMAC-SHA256 per reader (rtrl/signing.py): the sink checks the one
under the key its writer (the joiner, the gateway) shares with the sink alone, never the
trainer's or the joiner's, so the sink, which answers queries, can forge nothing another
process takes. A late record's MAC is for a purpose of its own: it holds a rollout's or an
event's bytes, which must never pass for a reward.

A record that fails is never stored: the sink keeps it in ``dead_letters`` with the reason,
and commits past it. So nothing that merely reaches the broker (the embedded one has no
ACLs) shows up in a table anything counts.

The topics are an allow-list, like the joiner's (reward_stream/authn.py): each topic the
sink reads names its writer, and a record from any other topic is refused as having no
known writer. The dead-letter topic is on the list as unverified: the joiner and the
trainer write the records they refused there, as they read them, unsigned. Its records
are stored as dead letters, as before, their reason saying that what their headers claim
is unverified; nothing but an operator reads ``dead_letters``.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

from rtrl import signing, topics
from rtrl.authn import TopicWriters, Unverified, Writer

if TYPE_CHECKING:
    from rtrl.analytics.config import AnalyticsSettings
    from rtrl.config import StackSettings

DEAD_LETTER = Unverified(
    "on the dead-letter topic, unverified: its writers (the joiner, the trainer) do not sign "
    "what they refused, so its headers, the reason included, are claims"
)


class Authenticator(TopicWriters):
    reader = "the sink"

    @classmethod
    def of(cls, settings: AnalyticsSettings, stack: StackSettings) -> Authenticator:
        """From the settings' keys; a ValueError if any set is empty (``python -m`` refuses
        that first, naming the variable: AnalyticsSettings.required_secrets)."""
        public = signing.parse_public_keys
        joiner_keys = signing.parse_mac_keys(settings.reward_mac_keys.get_secret_value())
        gateway = Writer(
            signing.MacVerifier(
                signing.parse_mac_keys(settings.event_keys.get_secret_value()),
                signing.Purpose.EVENT,
            ),
            "event not authenticated by the ingest gateway",
        )
        writers: dict[str, Writer | Unverified] = {
            topics.ROLLOUT: Writer(
                signing.Verifier(public(settings.rollout_public_keys), signing.Purpose.ROLLOUT),
                "rollout not signed by an inference worker",
            ),
            topics.EDIT: gateway,
            topics.PERSISTENCE: gateway,
            topics.FOLLOWUP: gateway,
            topics.REWARD: Writer(
                signing.MacVerifier(joiner_keys, signing.Purpose.REWARD),
                "reward not authenticated by the joiner",
            ),
            topics.REWARD_LATE: Writer(
                signing.MacVerifier(joiner_keys, signing.Purpose.REWARD_LATE),
                "late record not authenticated by the joiner",
            ),
            topics.TRAINER_STEPS: Writer(
                signing.Verifier(public(stack.manifest_public_keys), signing.Purpose.TRAINER_STEP),
                "trainer step not signed by the trainer",
            ),
            topics.REWARD_DLQ: DEAD_LETTER,
        }
        return cls(MappingProxyType(writers))
