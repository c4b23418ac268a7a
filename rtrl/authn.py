"""Who must have written each topic's records: the allow-list a reader checks every record
against before anything decodes it (the joiner's in reward_stream/authn.py, the analytics
sink's in analytics/authn.py). Each topic a reader reads names its writer and how the
writer authenticated it (rtrl/signing.py); a record from any other topic is refused as
having no known writer, never checked against a default.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from rtrl import signing

Headers = Sequence[tuple[str, bytes | None]]
"""A record's Kafka headers as a consumer reads them (Kafka allows a header without a value)."""


@dataclass(frozen=True)
class Writer:
    """Who must have written a topic's records, and how that is checked."""

    verifier: signing.Verifier | signing.MacVerifier
    refusal: str
    """Said of a record that fails, before the verifier's reason."""


@dataclass(frozen=True)
class Unverified:
    """A topic whose writers authenticate nothing: every record of it is refused, for this reason."""

    reason: str


@dataclass(frozen=True)
class TopicWriters:
    writers: Mapping[str, Writer | Unverified]
    """Topic -> its writer, for every topic the reader reads; there is no other."""

    reader: ClassVar[str] = "this reader"
    """Who reads: named when a record comes from a topic it does not read."""

    def problem(self, topic: str, value: bytes | None, headers: Headers | None) -> str | None:
        """None if the record's writer is who must write ``topic``; else why not."""
        writer = self.writers.get(topic)
        if writer is None:
            return f"no writer is known for topic {topic[:64]!r}: {self.reader} reads {sorted(self.writers)}"
        if isinstance(writer, Unverified):
            return writer.reason
        # A header without a value carries nothing to verify.
        present = [(name, data) for name, data in headers or () if data is not None]
        problem = writer.verifier.problem(value or b"", present)
        return problem and f"{writer.refusal}: {problem}"
