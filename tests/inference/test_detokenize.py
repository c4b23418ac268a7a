"""inference/detokenize.py: a stream's text released whole, token by token, adding up to the
decode of all of its tokens, with a byte-level BPE that splits characters across tokens."""

from __future__ import annotations

import random

import pytest

from rtrl.inference.detokenize import REPLACEMENT, IncrementalText
from rtrl.ops.tiny_model import bpe_tokenizer

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "naïve café — 東京 🚀🚀 done",
    "emoji only: 👩‍💻🧪",
]


@pytest.fixture(scope="module")
def tokenizer():
    return bpe_tokenizer()


def _stream(tokenizer, ids: list[int]) -> tuple[list[str], str]:
    text = IncrementalText(lambda window: tokenizer.decode(list(window)))
    pieces = [text.add(i) for i in ids]
    return pieces, text.rest()


@pytest.mark.parametrize("source", TEXTS)
def test_the_pieces_add_up_to_the_whole_and_none_holds_half_a_character(tokenizer, source):
    ids = tokenizer.encode(source)
    # The tokenizer's own pieces do split characters: the case this module exists for.
    assert any(REPLACEMENT in tokenizer.decode([i]) for i in ids) or source.isascii()
    pieces, rest = _stream(tokenizer, ids)
    assert "".join(pieces) + rest == tokenizer.decode(ids) == source
    assert rest == "" and not any(REPLACEMENT in piece for piece in pieces)


def test_text_comes_out_with_the_token_that_completes_it(tokenizer):
    ids = tokenizer.encode("ab 東")
    pieces, _ = _stream(tokenizer, ids)
    released = "".join(pieces[:-1])
    assert released == tokenizer.decode(ids[:-1]).rstrip(REPLACEMENT)
    assert pieces[-1]  # the last token completes 東: released at once, not at the end


def test_random_ids_add_up_to_their_decode_whatever_they_are(tokenizer):
    rng = random.Random(7)
    for _ in range(50):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
        pieces, rest = _stream(tokenizer, ids)
        assert "".join(pieces) + rest == tokenizer.decode(ids)
