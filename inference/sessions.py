"""Agent trajectories served turn by turn: token in, token out.

An agent's turns are tied by the ``trajectory_id`` it sends (in the body, or in the path:
a base URL of ``/v1/trajectories/{id}``, for an agent that lets you set nothing else).
The worker keeps each trajectory's exact ids: its first prompt, then what the policy
sampled and what it observed, turn after turn. A later request must extend them: its
messages repeat the ones already served, the assistant's turns exactly as they were
answered. Then only its new messages are rendered and tokenized (below), and the
policy's own earlier turns stay the ids it sampled: never re-rendered, never
re-tokenized, so what the trainer sees is what the policy saw.

A request that does not extend the trajectory (the agent compacted its history into a
summary, or edited it) ends the current link of the chain, whose record is then written,
and starts the next link, named as such (``not_an_extension``). Every link shares the
trajectory's rollout id: telemetry about it, and the reward it earns, reach every link.

A trajectory ends when the client ends it (``DELETE /v1/trajectories/{id}``), after
``trajectory_idle_s`` without a turn, at its turn or token limit, when the worker keeps
too many (the least recently used ends) or when the worker stops. Its last link's record
is written then, once. A worker that dies loses only its open trajectories; Redis
remembers which worker served each, so the client's next turn is told which was lost.

Rendering only the new messages: the chat template renders them after a synthetic user
turn and an assistant turn holding a marker (Miles' session server renders a synthetic
prefix too). What follows the marker is the end of an assistant turn, then the new
messages, then the next assistant turn's opening: the ids that follow the policy's last
sampled token. The end-of-turn token the policy sampled itself is not repeated.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from rtrl.api_keys import ApiKey
from rtrl.checkpoint import ChatTemplateError, Checkpoint
from rtrl.inference.batch import SequenceParams
from rtrl.inference.chat_messages import Canonical, ChatMessage, Tool, answered_message
from rtrl.inference.config import InferenceSettings
from rtrl.inference.engine import Completion
from rtrl.inference.recording import KeptFromTraining, Record, RolloutPublisher
from rtrl.inference.records import RolloutContext, generated_segment, trajectory_record
from rtrl.trajectory import Link, LinkReason, Segment, SegmentKind, ToolCall, Trajectory

log = logging.getLogger(__name__)

OWNER_PREFIX = "rtrl:trajectory:"
"""Redis: ``<prefix><client>:<trajectory id>`` names the worker serving it."""

_USER_MARK = "rtrl-synthetic-user-7f3a"
_MARK = "rtrl-turn-boundary-7f3a"


class TrajectoryConflict(Exception):
    """A turn the worker cannot serve as asked (answered 409, naming the trajectory)."""


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


class Sessions:
    """The open trajectories of one worker."""

    def __init__(
        self,
        settings: InferenceSettings,
        *,
        policy: Checkpoint,
        publisher: RolloutPublisher,
        redis: aioredis.Redis,
        worker_id: str,
        model_name: str,
        forget: Callable[[str], None] = lambda session: None,
    ) -> None:
        """``forget(session)``: a link ended, the engine may drop what it kept for it."""
        self.settings = settings
        self._forget = forget
        self.policy = policy
        self.publisher = publisher
        self._redis = redis
        self.worker_id = worker_id
        self._owner = f"{worker_id}/{uuid.uuid4().hex[:12]}"
        """This run of the worker: a restarted worker does not own what it served before."""
        self.model_name = model_name
        self.max_tokens = settings.trajectory_max_tokens or policy.max_positions
        self._owner_ttl_s = int(settings.trajectory_idle_s) + 60
        """Redis remembers who serves a trajectory a minute past its idle end."""
        self._open: OrderedDict[tuple[str, str], Session] = OrderedDict()
        self.ended = 0
        """Trajectories ended (their last link written, or not recorded)."""

    def __len__(self) -> int:
        return len(self._open)

    async def plan(
        self,
        client_id: str,
        trajectory_id: str,
        messages: Sequence[ChatMessage],
        tools: Sequence[Tool],
        opening: Opening,
    ) -> Plan:
        """The prompt of the trajectory's next turn; the session is busy until
        ``complete`` or ``abandon``. Raises TrajectoryConflict, or ChatTemplateError."""
        key = (client_id, trajectory_id)
        tools_json = json.dumps([t.template_tool() for t in tools], sort_keys=True)
        canonical = tuple(m.canonical() for m in messages)
        session = self._open.get(key)
        if session is not None and session.busy:
            raise TrajectoryConflict(
                f"trajectory {trajectory_id!r} is serving a turn: send its next turn after "
                "that one is answered"
            )
        if session is None:
            session = await self._new(key, opening, tools_json)
        session.busy = True
        session.last_used = time.monotonic()
        self._open.move_to_end(key)
        try:
            await self._redis.expire(_owner_key(key), self._owner_ttl_s)
            if session.ids and _extends(session, canonical, tools_json):
                new = messages[len(session.messages) :]
                added = await asyncio.to_thread(self._continuation, session, new, tools)
                source = "tool" if any(m.role == "tool" for m in new) else new[0].role
                return Plan(session, session.ids + added, tuple(added), canonical, source)
            if session.ids:
                await self._next_link(session, tools_json)
            rendered = [m.template_message() for m in messages]
            template_tools = [t.template_tool() for t in tools]
            prompt = await asyncio.to_thread(self.policy.render_chat, rendered, template_tools)
            return Plan(session, prompt, tuple(prompt), canonical, "prompt")
        except BaseException:
            self.abandon(session)
            raise

    def complete(
        self,
        plan: Plan,
        completion: Completion,
        content: str,
        answered_calls: list[dict[str, Any]],
        tool_calls: Sequence[ToolCall],
        finish_reason: str,
    ) -> bool:
        """Add the served turn; True when it ended the trajectory (``end`` it then)."""
        session = plan.session
        if not session.ids:
            session.prompt_ids = tuple(plan.added)
            session.params = completion.params
            session.ttft_s = completion.ttft_s
        else:
            session.segments.append(Segment.observed(plan.added, plan.source))
        generated = generated_segment(completion)
        session.segments.append(generated)
        session.ids = plan.prompt_ids + list(generated.token_ids)
        session.tool_calls.extend(tool_calls)
        session.messages = [*plan.messages, answered_message(content, answered_calls).canonical()]
        session.final_text, session.finish_reason = content, finish_reason
        session.latency_s += completion.latency_s
        session.turns += 1
        session.busy = False
        session.last_used = session.answered = time.monotonic()
        full = len(session.ids) >= self.max_tokens
        return full or session.turns >= self.settings.trajectory_max_turns

    def note(self, plan: Plan, *, private: bool, kept: KeptFromTraining | None) -> None:
        """A turn's recording decision: one private or kept turn keeps the whole link."""
        session = plan.session
        session.private = session.private or private
        session.kept = session.kept or kept

    def abandon(self, session: Session) -> None:
        """A turn that was not served: the trajectory is as it was."""
        session.busy = False
        if session.turns == 0:  # a trajectory never served: it was not opened
            self._open.pop(self._key_of(session), None)

    def engine_session(self, plan: Plan) -> str:
        """The key the engine keeps the link's keys and values under, between turns."""
        return _engine_key(plan.session)

    def turn_of(self, plan: Plan) -> int:
        """The index of the turn being served among its link's assistant turns."""
        return sum(s.kind is SegmentKind.GENERATED for s in plan.session.segments)

    async def end(self, client_id: str, trajectory_id: str) -> Session | None:
        """End a trajectory at the client's word; None if it is not open here."""
        session = self._open.get((client_id, trajectory_id))
        if session is None or session.busy:
            return None
        await self._close(session)
        return session

    async def sweep(self) -> None:
        """End idle trajectories, and those open for trajectory_max_s, every second, until
        cancelled. A trajectory whose end fails (Redis unreachable) is logged and the sweep
        goes on."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            idle, old = now - self.settings.trajectory_idle_s, now - self.settings.trajectory_max_s
            for session in [
                s
                for s in self._open.values()
                if (s.last_used < idle or s.opened < old) and not s.busy
            ]:
                try:
                    await self._close(session)
                except Exception:
                    log.exception("trajectory %s: its idle end failed", session.trajectory_id)

    async def close_all(self) -> None:
        """The worker is stopping: every open trajectory ends and is written."""
        for session in list(self._open.values()):
            await self._close(session)

    # ---- internals -----------------------------------------------------------------

    def _key_of(self, session: Session) -> tuple[str, str]:
        return (session.opening.client_id, session.trajectory_id)

    async def _new(self, key: tuple[str, str], opening: Opening, tools_json: str) -> Session:
        """A new trajectory, held (busy) from before the first await: a second request for
        the same id meanwhile is refused as a concurrent turn."""
        session = Session(key[1], opening, tools_json, busy=True)
        self._open[key] = session
        try:
            while len(self._open) > self.settings.max_trajectories:
                idle = next((s for s in self._open.values() if not s.busy), None)
                if idle is None:
                    raise TrajectoryConflict(
                        f"this worker serves {len(self._open) - 1} trajectories, all mid-turn"
                    )
                await self._close(idle)
            await self._check_not_lost(key)
            await self._redis.set(_owner_key(key), self._owner, ex=self._owner_ttl_s)
            await self.publisher.mark_served(opening.rollout_id, opening.key)
        except BaseException:
            del self._open[key]
            raise
        return session

    async def _check_not_lost(self, key: tuple[str, str]) -> None:
        """Raise TrajectoryConflict, once, for a trajectory an earlier run or another
        worker was serving: its turns so far are gone."""
        stored = await self._redis.getdel(_owner_key(key))
        owner = stored.decode() if isinstance(stored, bytes) else stored
        if owner is not None and owner != self._owner:
            worker = owner.partition("/")[0]
            raise TrajectoryConflict(
                f"trajectory {key[1]!r} was served by worker {worker!r}, which no longer holds "
                "it (the worker restarted, or this request reached another one): its turns "
                "so far are lost; this trajectory id starts anew on the next request"
            )

    async def _next_link(self, session: Session, tools_json: str) -> None:
        """The request does not extend the link: write it, and start the next."""
        self._forget(_engine_key(session))
        await self._write(session, final=False)
        session.position += 1
        session.reason = LinkReason.NOT_AN_EXTENSION
        session.tools = tools_json
        session.messages, session.ids, session.prompt_ids = [], [], ()
        session.segments, session.tool_calls = [], []
        session.kept, session.private, session.latency_s = None, False, 0.0
        session.link_opened = time.monotonic()

    def _continuation(
        self, session: Session, new: Sequence[ChatMessage], tools: Sequence[Tool]
    ) -> list[int]:
        return continuation_ids(
            self.policy,
            session.ids[-1],
            [m.template_message() for m in new],
            [t.template_tool() for t in tools],
        )

    async def _close(self, session: Session) -> None:
        key = self._key_of(session)
        if self._open.get(key) is not session:
            return
        del self._open[key]
        self.ended += 1
        self._forget(_engine_key(session))
        await self._write(session, final=True)  # first: the record does not wait on Redis
        await self._redis.delete(_owner_key(key))

    async def _write(self, session: Session, *, final: bool) -> None:
        """The link's record, unless it holds no turn or is private or kept from training."""
        if not session.segments or session.private or session.kept is not None:
            return
        o = session.opening
        assert session.params is not None
        trajectory = Trajectory(
            prompt_ids=session.prompt_ids,
            segments=tuple(session.segments),
            final_text=session.final_text,
            tool_calls=tuple(session.tool_calls),
            prompt_text=self.policy.decode(session.prompt_ids),
            finish_reason=session.finish_reason,
            link=Link(session.trajectory_id, session.position, final, session.reason),
        )
        context = RolloutContext(
            rollout_id=o.rollout_id,
            session_id=o.session_id,
            user_id=o.user_id,
            client_ts_ms=o.client_ts_ms,
            worker_id=self.worker_id,
            model_name=self.model_name,
            prompt_text=trajectory.prompt_text,
            prompt_group_id=o.prompt_group_id,
            context_key=o.context_key,
            traceparent=o.traceparent,
            client_id=o.client_id,
        )
        record = trajectory_record(
            context,
            trajectory,
            arm=o.arm,
            params=session.params,
            latency_s=session.latency_s,
            ttft_s=session.ttft_s,
            wall_s=session.answered - session.link_opened,
        )
        recording = await self.publisher.seal(record)
        if isinstance(recording, Record):
            try:
                await self.publisher.publish(o.rollout_id, recording, o.key, o.traceparent)
            except Exception:
                log.exception("trajectory %s: its record was not written", session.trajectory_id)
                return
        else:
            session.kept = recording


def continuation_ids(
    policy: Checkpoint,
    last_id: int,
    new: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]],
) -> list[int]:
    """The ids after a turn whose last sampled token is ``last_id``: the end of the
    policy's turn (less the end token it sampled), the ``new`` messages (as the template
    reads them), the next turn's opening. Raises ChatTemplateError."""
    synthetic = [
        {"role": "user", "content": _USER_MARK},
        {"role": "assistant", "content": _MARK},
        *new,
    ]
    text = policy.render_text(synthetic, tools)
    at = text.find(_MARK)
    if at < 0 or text.find(_MARK, at + 1) >= 0:
        raise ChatTemplateError(
            "the chat template does not render an assistant turn's content as given, so "
            "a trajectory's next turn cannot be told from its history"
        )
    tail = text[at + len(_MARK) :]
    if last_id in policy.eos_token_ids:
        tail = tail.removeprefix(str(policy.tokenizer.convert_ids_to_tokens(last_id)))
    return policy.tokenize(tail)


def _extends(session: Session, messages: tuple[Canonical, ...], tools_json: str) -> bool:
    """The request repeats the link's messages and tools, and adds at least one message."""
    n = len(session.messages)
    return (
        tools_json == session.tools
        and len(messages) > n
        and messages[:n] == tuple(session.messages)
    )


def _engine_key(session: Session) -> str:
    return f"{session.opening.client_id}/{session.trajectory_id}/{session.position}"


def _owner_key(key: tuple[str, str]) -> str:
    return f"{OWNER_PREFIX}{key[0]}:{key[1]}"
