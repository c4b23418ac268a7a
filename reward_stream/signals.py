"""User-behaviour signals the reward is built from: edit persistence and dissatisfaction,
and whether a completion proposes code at all.

All are functions of text, so they can be tested as tables and swapped
independently. Dissatisfaction has two scorers: the regex rules (``is_dissatisfied``,
always available) and the trained classifier (``reward_stream.classifier``, when the
packaged all-MiniLM-L6-v2 weights are installed); ``dissatisfaction`` picks the
classifier when it loads and the rules otherwise.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from difflib import SequenceMatcher

log = logging.getLogger(__name__)


# An indented line: code, whatever the language (2-space bodies included); prose is
# rarely indented. Shared by reward r3 and the hacking monitor so they agree on it.
_INDENTED_LINE = re.compile(r"^(\t| {2,})\S", re.MULTILINE)


def has_code(completion_text: str) -> bool:
    """True if the text contains code: a ``` fence or a line indented by a tab or 2+ spaces."""
    return "```" in completion_text or _INDENTED_LINE.search(completion_text) is not None


def _non_empty_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def persisted_fraction(agent_text: str, region_text: str) -> float:
    """Fraction of the agent's non-empty lines still present, in order, in the region.

    Lines match only exactly (indentation and quotes included: in the task family a
    one-character style difference is exactly what users rewrite). Blank lines are
    ignored on both sides so reflowing whitespace does not count as a rewrite. The
    alignment is difflib's SequenceMatcher over lines, so a line the user moved
    across other kept lines may count as rewritten. An agent text with no
    non-empty lines persisted nothing: 0.0.
    """
    if agent_text == region_text:
        # Kept as it was: the common case, and the diff's costliest.
        return 1.0 if agent_text.strip() else 0.0
    agent_lines = _non_empty_lines(agent_text)
    if not agent_lines:
        return 0.0
    region_lines = _non_empty_lines(region_text)
    if agent_lines == region_lines:
        return 1.0
    # autojunk would treat frequent lines (e.g. "}" or "pass") as junk in long regions.
    matcher = SequenceMatcher(a=agent_lines, b=region_lines, autojunk=False)
    kept = sum(block.size for block in matcher.get_matching_blocks())
    return kept / len(agent_lines)


# Patterns of annoyed follow-ups. Word boundaries keep "no" out of "now" and "know",
# and "stop" out of "stopwatch".
_DISSATISFIED_PATTERNS = (
    r"^\s*no\b",  # "no, ...", "no that's wrong", "no." at the start
    r"\bnope\b",
    r"\bwrong\b",
    r"\bincorrect\b",
    r"\bbroke(n)?\b",
    r"\bbreaks\b",
    r"\b(doesn'?t|does not|didn'?t|did not|won'?t|isn'?t|is not) (work|compile|run|build|pass)",
    r"\bdoesn'?t\b",
    r"\brevert",
    r"\bundo\b",
    r"\bnot what i\b",
    r"\bthat'?s not\b",
    r"\buse \S.* instead\b",
    r"\bwhy did you\b",
    r"\bwhy would you\b",
    r"\bi (said|asked|told you)\b",
    r"\bstop\b",
    r"\bugh+\b",
    r"\bwtf\b",
    r"\buseless\b",
    r"\bterrible\b",
    r"\bstill (fails|failing|broken|wrong)\b",
)
_DISSATISFIED = re.compile("|".join(f"(?:{p})" for p in _DISSATISFIED_PATTERNS), re.IGNORECASE)


def is_dissatisfied(message: str) -> bool:
    """True if a follow-up message reads as the user being unhappy with the edit.

    A keyword/regex rule set: high precision on blunt complaints ("no, that broke
    the build", "use tabs instead", "why did you delete that"), blind to sarcasm
    and polite corrections. Neutral or positive follow-ups ("thanks", "now add
    tests") are not dissatisfied.
    """
    return _DISSATISFIED.search(message) is not None


def _rule_scores(messages: list[str]) -> list[float]:
    return [1.0 if is_dissatisfied(m) else 0.0 for m in messages]


@functools.cache
def _scorer() -> Callable[[list[str]], list[float]]:
    # Chosen once per process, on first use, so importing signals stays cheap and the
    # log says once which scorer every reward of this process came from.
    from rtrl.reward_stream import classifier

    try:
        model = classifier.DissatisfactionClassifier(
            classifier.load_encoder(), classifier.load_head()
        )
    except ImportError as exc:
        log.warning("dissatisfaction: rule fallback (trained classifier unavailable: %s)", exc)
        return _rule_scores
    log.info("dissatisfaction: trained classifier (%s + logistic head)", classifier.ENCODER_NAME)
    return model.probability


def dissatisfaction(messages: list[str]) -> list[float]:
    """P(dissatisfied) per follow-up message, in order.

    The trained classifier's probability when it can be loaded, else the rules as 1.0
    or 0.0. Batch the messages of many rollouts into one call: the classifier embeds
    them together and caches repeated messages.
    """
    return _scorer()(messages)
