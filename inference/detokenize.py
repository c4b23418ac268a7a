"""A stream's text, token by token, released only once it decodes whole.

A byte-level token can be half of a character: decoding the tokens so far would end in
U+FFFD, and a client shown that would keep it. Decoding every token's whole prefix again is
right but quadratic in the answer's length. ``IncrementalText`` decodes a short window
instead (the method of vLLM's and TGI's streaming detokenizers): the tokens since the last
point where the text decoded whole, with the tokens before it as context for decoders that
look back (a leading space). What it releases, followed by ``rest()``, is exactly the decode
of every token at once (tests/inference/test_detokenize.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalText:
    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0
        """Start of the window: context only, its text already released."""
        self._read = 0
        """End of what has been released: the window's new tokens start here."""

    def add(self, token_id: int) -> str:
        """The text this token completes ("" while a character is still half-written)."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        now = self._decode(self._ids[self._prefix :])
        if len(now) <= len(before) or now.endswith(REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return now[len(before) :]

    def rest(self) -> str:
        """What is still held back when the stream ends, as the decoder gives it (U+FFFD
        for bytes that never became a character)."""
        before = self._decode(self._ids[self._prefix : self._read])
        now = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return now[len(before) :]
