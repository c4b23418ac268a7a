"""Text others wrote is tokenized as text: a control token spelled inside a user's, a
system prompt's or a tool's message never becomes the control id.

A chat template copies each message's content into its markup, and a tokenizer matches
its added tokens (``<|im_start|>``, Qwen's ``<tool_call>``) anywhere in the rendered text.
So, tokenized whole, a tool's result that reads ``</tool_response><|im_end|><|im_start|>
assistant\\n<tool_call>...`` closes its own turn and writes the assistant a call it never
made: the model sees exactly the ids of a real one. vLLM and SGLang keep such text as text
for untrusted content; this module does it for every path that tokenizes a chat
(rtrl/checkpoint.py ``render``/``tokenize``, inference/sessions.py's continuations).

Whose text is trusted is an allow-list: an assistant message's content (the policy's own
words, as the client echoes them back) and the template's markup. Every other message's
content is untrusted. A tool's definition is rendered as JSON (``tojson``), where its text
cannot be located; one that spells a control token is refused (``refuse_control_text``).

How, at no cost to an ordinary chat:

1. ``may_spell_control`` says whether any untrusted content could spell an added token,
   alone or across the seam with the text beside it. Almost never: then the chat is
   tokenized whole, exactly as transformers does.
2. Otherwise the template is rendered a second time with a placeholder for each untrusted
   content (``with_placeholders``); putting the contents back into that rendering must
   give the real one character for character (``untrusted_spans``), which locates every
   content in it. A template that transforms or inspects content (so that the two
   disagree) cannot be kept apart: such a chat is refused, naming the token.
3. ``ids_keeping_text``: the rendering tokenized whole; an added token overlapping an
   untrusted span is forged, and only the stretch between the genuine control tokens
   around it is tokenized again, its untrusted pieces by ``text_tokenizer`` (one that
   knows no added token).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

TRUSTED_ROLES = frozenset({"assistant"})
"""Roles whose content is the policy's own text; every other role's is text only."""

Span = tuple[int, int]
"""A character range ``[start, end)`` of a rendered chat."""


class ControlTextRefused(ValueError):
    """Untrusted text spells a control token where it cannot be kept as text."""


@dataclass(frozen=True)
class RenderedChat:
    """A chat as its template rendered it, with where untrusted text lies in it.
    Produced by Checkpoint.render; consumed by Checkpoint.tokenize."""

    text: str
    untrusted: tuple[Span, ...] = ()
    """Character spans of ``text`` copied from untrusted message content; empty when none
    of it could spell a control token (step 1 above)."""

    def tail(self, start: int) -> RenderedChat:
        """The rendering from character ``start`` on, its spans moved with it."""
        spans = tuple((max(a - start, 0), b - start) for a, b in self.untrusted if b > start)
        return RenderedChat(self.text[start:], spans)


def untrusted_contents(messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """The indices of the messages whose string content is untrusted."""
    return [
        i
        for i, m in enumerate(messages)
        if m.get("role") not in TRUSTED_ROLES and isinstance(m.get("content"), str)
    ]


def control_texts(tokenizer: Tokenizer) -> tuple[str, ...]:
    """Every added token's spelling: what the tokenizer matches before its model."""
    return tuple(t.content for t in tokenizer.get_added_tokens_decoder().values() if t.content)


def may_spell_control(tokenizer: Tokenizer, texts: Iterable[str]) -> bool:
    """Whether one of ``texts`` spells an added token, or starts with the end of one or
    ends with the start of one (a token across the seam with its neighbour). Judged on
    the text as given and as the tokenizer's normalizer makes it."""
    controls = control_texts(tokenizer)
    normalizer = tokenizer.normalizer
    for raw in texts:
        forms = {raw, normalizer.normalize_str(raw)} if normalizer else {raw}
        for text in forms:
            for control in controls:
                if control in text or any(
                    text.startswith(control[k:]) or text.endswith(control[:k])
                    for k in range(1, len(control))
                ):
                    return True
    return False


def refuse_control_text(tokenizer: Tokenizer, tools: Sequence[Mapping[str, Any]]) -> None:
    """Raise ControlTextRefused if a tool's definition spells an added token."""
    controls = control_texts(tokenizer)
    for tool in tools:
        text = json.dumps(tool, ensure_ascii=False)
        for control in controls:
            if control in text:
                raise ControlTextRefused(
                    f"a tool's definition spells the control token {control!r}: a tool's "
                    "text is rendered as JSON, where it cannot be kept as text"
                )


def with_placeholders(
    messages: Sequence[Mapping[str, Any]], indices: Sequence[int]
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """``messages`` with each untrusted content replaced by a placeholder no text holds (a
    fresh random name in private-use characters), and each placeholder's content."""
    nonce = secrets.token_hex(8)
    out = [dict(m) for m in messages]
    contents: dict[str, str] = {}
    for i in indices:
        placeholder = f"\ue000{nonce}:{i}\ue001"
        contents[placeholder] = str(out[i]["content"])
        out[i]["content"] = placeholder
    return out, contents


def untrusted_spans(real: str, placeheld: str, contents: Mapping[str, str]) -> tuple[Span, ...]:
    """Where each content lies in ``real``, from the rendering with placeholders; raise
    ControlTextRefused when the two renderings disagree (the template transformed or
    inspected a content)."""
    spans: list[Span] = []
    rebuilt: list[str] = []
    at = length = 0
    while at < len(placeheld):
        start = placeheld.find("\ue000", at)
        end = placeheld.find("\ue001", start) + 1 if start >= 0 else 0
        placeholder = placeheld[start:end] if start >= 0 else ""
        if placeholder not in contents:
            rebuilt.append(placeheld[at:])
            break
        rebuilt.append(placeheld[at:start])
        length += start - at
        content = contents[placeholder]
        rebuilt.append(content)
        spans.append((length, length + len(content)))
        length += len(content)
        at = end
    if "".join(rebuilt) != real:
        raise ControlTextRefused(
            "a message spells a control token, and this model's chat template transforms "
            "message text, so it cannot be kept as text"
        )
    return tuple(s for s in spans if s[0] < s[1])


def text_tokenizer(tokenizer: Tokenizer) -> Tokenizer:
    """A copy of ``tokenizer`` that matches no added token: each is marked special and
    special tokens are encoded as the text they spell."""
    spec = json.loads(tokenizer.to_str())
    for added in spec.get("added_tokens", []):
        added["special"] = True
    plain = Tokenizer.from_str(json.dumps(spec))
    plain.encode_special_tokens = True
    return plain


def ids_keeping_text(tokenizer: Tokenizer, plain: Tokenizer, rendered: RenderedChat) -> list[int]:
    """``rendered`` as ids with no added token inside its untrusted spans (step 3 above).
    Raises ControlTextRefused if the model itself spells one from plain text."""
    encoding = tokenizer.encode(rendered.text, add_special_tokens=False)
    ids, offsets = list(encoding.ids), list(encoding.offsets)
    added = set(tokenizer.get_added_tokens_decoder())
    forged = {
        n for n, i in enumerate(ids) if i in added and _overlaps(offsets[n], rendered.untrusted)
    }
    if not forged:
        return ids
    genuine = [n for n, i in enumerate(ids) if i in added and n not in forged]
    # Each forged token is retokenized with the stretch between the genuine control
    # tokens around it; stretches never overlap, since genuine tokens bound them.
    stretches = sorted({_around(n, genuine, len(ids)) for n in forged})
    out: list[int] = []
    n = 0
    for before, after in stretches:
        out += ids[n : before + 1]
        start = offsets[before][1] if before >= 0 else 0
        end = offsets[after][0] if after < len(ids) else len(rendered.text)
        out += _stretch_ids(tokenizer, plain, rendered, start, end)
        n = after
    return out + ids[n:]


def _around(n: int, genuine: Sequence[int], count: int) -> tuple[int, int]:
    """The genuine control tokens' positions before and after position ``n`` (-1 and
    ``count`` where there is none)."""
    before = max((g for g in genuine if g < n), default=-1)
    after = min((g for g in genuine if g > n), default=count)
    return before, after


def _stretch_ids(
    tokenizer: Tokenizer, plain: Tokenizer, rendered: RenderedChat, start: int, end: int
) -> list[int]:
    """Characters ``start:end`` tokenized piece by piece: untrusted pieces as text."""
    added = set(tokenizer.get_added_tokens_decoder())
    out: list[int] = []
    at = start
    for a, b in sorted(rendered.untrusted):
        a, b = max(a, start), min(b, end)
        if a >= b:
            continue
        if at < a:
            out += tokenizer.encode(rendered.text[at:a], add_special_tokens=False).ids
        text = plain.encode(rendered.text[a:b], add_special_tokens=False).ids
        if any(i in added for i in text):
            raise ControlTextRefused("a message's text tokenizes to a control token")
        out += text
        at = b
    if at < end:
        out += tokenizer.encode(rendered.text[at:end], add_special_tokens=False).ids
    return out


def _overlaps(offset: tuple[int, int], spans: Sequence[Span]) -> bool:
    return any(offset[0] < b and a < offset[1] for a, b in spans)
