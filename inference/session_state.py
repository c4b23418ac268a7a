"""What the serving API keeps of one agent's trajectory (inference/sessions.py): who it is
for and how it was first asked (``Opening``), its current link (``Session``), one turn's
prompt (``Plan``), and the refusals a turn can meet.

Produced and owned by ``Sessions``; read by the request path (inference/asks.py,
inference/completions.py) and by the link's record (inference/records.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rtrl.api_keys import ApiKey
from rtrl.inference.api import FieldRefused
from rtrl.inference.batch import SequenceParams
from rtrl.inference.chat_messages import Canonical
from rtrl.inference.recording import KeptFromTraining
from rtrl.trajectory import LinkReason, Segment, ToolCall


class TrajectoryConflict(Exception):
    """A turn the worker cannot serve as asked (answered 409, naming the trajectory)."""


class TrajectoriesFull(Exception):
    """No room for a new trajectory without ending another client's: 429 when the client
    holds its share, 503 when the worker holds its bound (another worker may have room)."""

    def __init__(self, status: int, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Opening:
    """Who a trajectory is for and how it was first asked: its record's context."""

    rollout_id: str
    client_id: str
    key: ApiKey | None
    user_id: str
    arm: str
    session_id: str
    traceparent: str
    client_ts_ms: int
    prompt_group_id: str
    context_key: str


@dataclass
class Session:
    """One open trajectory: its current link's ids, turns and calls."""

    trajectory_id: str
    opening: Opening
    tools: str
    """The offered tools, as canonical JSON: the template rendered them into the prompt."""
    position: int = 0
    reason: LinkReason = LinkReason.FIRST
    messages: list[Canonical] = field(default_factory=list)
    """The link's messages so far, canonical (ChatMessage.canonical), answered turns too."""
    ids: list[int] = field(default_factory=list)
    prompt_ids: tuple[int, ...] = ()
    segments: list[Segment] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    final_text: str = ""
    finish_reason: str = ""
    params: SequenceParams | None = None
    latency_s: float = 0.0
    ttft_s: float = 0.0
    turns: int = 0
    """Assistant turns in all links."""
    kept: KeptFromTraining | None = None
    private: bool = False
    busy: bool = False
    last_used: float = field(default_factory=time.monotonic)
    opened: float = field(default_factory=time.monotonic)
    link_opened: float = field(default_factory=time.monotonic)
    """When the link's first request arrived (its wall time runs from here)."""
    answered: float = 0.0
    """When its last turn was answered."""


@dataclass(frozen=True)
class Plan:
    """What one turn generates from: the whole prompt, and what it added."""

    session: Session
    prompt_ids: list[int]
    added: tuple[int, ...]
    """The ids this turn put after the trajectory's (all of them, in a link's first turn)."""
    messages: tuple[Canonical, ...]
    """The request's messages, canonical."""
    source: str


def check_same_party(opening: Opening, user: str | None, arm: str | None) -> None:
    """Raise FieldRefused for a turn naming another end user or arm than its trajectory
    was opened with: one rollout is sampled by one arm's policy, and its reward credits
    that arm."""
    if user is not None and user != opening.user_id:
        raise FieldRefused(
            "user",
            f"this trajectory was opened for another end user: a trajectory keeps its user "
            f"and its arm ({opening.arm}); start another trajectory for {user!r}",
        )
    if arm is not None and arm != opening.arm:
        raise FieldRefused(
            "arm", f"this trajectory was opened in arm {opening.arm!r}, and keeps it"
        )


def extends(session: Session, messages: tuple[Canonical, ...], tools_json: str) -> bool:
    """The request repeats the link's messages and tools, and adds at least one message."""
    n = len(session.messages)
    return (
        tools_json == session.tools
        and len(messages) > n
        and messages[:n] == tuple(session.messages)
    )
