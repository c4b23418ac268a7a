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

A turn is a transaction (``Sessions.turn``): ``plan`` holds the trajectory busy and
``complete`` commits the turn; whatever else ends it (a refusal, an engine error, a client
gone mid-stream, a worker stopping) releases the trajectory as it was. A trajectory keeps
the end user and the arm it was opened with: a turn naming another is refused (400).

A trajectory ends when the client ends it (``DELETE /v1/trajectories/{id}``), after
``trajectory_idle_s`` without a turn, at its turn or token limit, when its client opens
more than its share (``max_trajectories_per_client``) or the worker holds its bound
(``max_trajectories``): then the client's own least recently used idle one ends, never
another client's (with none idle, the newcomer is refused: 429 past its share, 503 for a
full worker). Its last link's record is written then, once; one a worker ended for room
tells its next turn so (409), once. The sweep ends a turn running past
``trajectory_max_s`` too, so no state outlives it. A worker that dies loses only its open
trajectories; Redis remembers which worker served each, so the client's next turn is told
which was lost.

Rendering only the new messages: the chat template renders them after a synthetic user
turn and an assistant turn holding a marker (Miles' session server renders a synthetic
prefix too). What follows the marker is the end of an assistant turn, then the new
messages, then the next assistant turn's opening: the ids that follow the policy's last
sampled token. The end-of-turn token the policy sampled itself is not repeated.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis

from rtrl.checkpoint import ChatTemplateError, Checkpoint
from rtrl.inference.chat_messages import ChatMessage, Tool, answered_message
from rtrl.inference.config import InferenceSettings
from rtrl.inference.engine import Completion
from rtrl.inference.recording import KeptFromTraining, Record, RolloutPublisher
from rtrl.inference.records import RolloutContext, generated_segment, trajectory_record
from rtrl.inference.session_state import (
    Opening,
    Plan,
    Session,
    TrajectoriesFull,
    TrajectoryConflict,
    check_same_party,
    extends,
)
from rtrl.trajectory import Link, LinkReason, Segment, SegmentKind, ToolCall, Trajectory

log = logging.getLogger(__name__)

OWNER_PREFIX = "rtrl:trajectory:"
"""Redis: ``<prefix><client>:<trajectory id>`` names the worker serving it, or (ENDED) why
the worker ended it to make room."""
ENDED = "ended:"
"""An owner value: the worker ended the trajectory for room; its next turn is told (once)."""

_USER_MARK = "rtrl-synthetic-user-7f3a"
_MARK = "rtrl-turn-boundary-7f3a"


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
        """Least recently used first, keyed by (client, trajectory id)."""
        self._per_client: Counter[str] = Counter()
        """Open trajectories per client."""
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
        *,
        named_user: str | None = None,
        named_arm: str | None = None,
    ) -> Plan:
        """The prompt of the trajectory's next turn; the session is busy until
        ``complete`` or ``abandon`` (``turn`` does one or the other). ``named_user`` and
        ``named_arm``: what the request named (None: nothing), refused unless the
        trajectory's own. Raises TrajectoryConflict, TrajectoriesFull, FieldRefused or
        ChatTemplateError."""
        key = (client_id, trajectory_id)
        tools_json = json.dumps([t.template_tool() for t in tools], sort_keys=True)
        canonical = tuple(m.canonical() for m in messages)
        session = self._open.get(key)
        if session is not None and session.busy:
            raise TrajectoryConflict(
                f"trajectory {trajectory_id!r} is serving a turn: send its next turn after "
                "that one is answered"
            )
        if session is not None:
            check_same_party(session.opening, named_user, named_arm)
        else:
            session = await self._new(key, opening, tools_json)
        session.busy = True
        session.last_used = time.monotonic()
        self._open.move_to_end(key)
        try:
            await self._redis.expire(_owner_key(key), self._owner_ttl_s)
            if session.ids and extends(session, canonical, tools_json):
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

    @contextlib.asynccontextmanager
    async def turn(self, plan: Plan | None) -> AsyncIterator[None]:
        """A turn as a transaction, from its ``plan`` to its answer: ``complete`` commits
        it, and whatever else ends it (a refusal, an engine error, a client gone
        mid-stream, a worker stopping) releases its trajectory as it was, so no path leaves
        it busy. Enter it right after ``plan`` returns (no await between). None: a request
        outside any trajectory, holding nothing."""
        try:
            yield
        finally:
            if plan is not None and plan.session.busy:
                self.abandon(plan.session)

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
            self._drop(session)

    def engine_session(self, plan: Plan) -> str:
        """The key the engine keeps the link's keys and values under, between turns."""
        return _engine_key(plan.session)

    def turn_of(self, plan: Plan) -> int:
        """The index of the turn being served among its link's assistant turns."""
        return sum(s.kind is SegmentKind.GENERATED for s in plan.session.segments)

    async def end(self, client_id: str, trajectory_id: str) -> Session | None:
        """End a trajectory at the client's word; None if it is not open here. Raises
        TrajectoryConflict while it serves a turn."""
        session = self._open.get((client_id, trajectory_id))
        if session is None:
            return None
        if session.busy:
            raise TrajectoryConflict(
                f"trajectory {trajectory_id!r} is serving a turn: end it once that is answered"
            )
        await self._close(session)
        return session

    async def sweep(self) -> None:
        """Every second until cancelled, end what ``stale`` names. A trajectory whose end
        fails (Redis unreachable) is logged and the sweep goes on."""
        while True:
            await asyncio.sleep(1.0)
            for session in self.stale(time.monotonic()):
                if session.busy:
                    log.warning(
                        "trajectory %s: a turn ran past trajectory_max_s; the trajectory "
                        "ends without it",
                        session.trajectory_id,
                    )
                try:
                    await self._close(session)
                except Exception:
                    log.exception("trajectory %s: its idle end failed", session.trajectory_id)

    def stale(self, now: float) -> list[Session]:
        """The trajectories to end at ``now``, in every state: idle for trajectory_idle_s,
        open for trajectory_max_s, or mid-turn for trajectory_max_s (no turn takes that
        long but a leaked one)."""
        s = self.settings
        idle, old = now - s.trajectory_idle_s, now - s.trajectory_max_s
        return [
            session
            for session in self._open.values()
            if session.last_used < old
            or (not session.busy and (session.last_used < idle or session.opened < old))
        ]

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
        self._per_client[key[0]] += 1
        try:
            await self._check_not_lost(key)
            await self._make_room(key[0])
            await self._redis.set(_owner_key(key), self._owner, ex=self._owner_ttl_s)
            await self.publisher.mark_served(opening.rollout_id, opening.key)
        except BaseException:
            self._drop(session)
            raise
        return session

    async def _make_room(self, client_id: str) -> None:
        """Room for the trajectory ``client_id`` just opened (already counted): past its
        share or the worker's bound, the client's own least recently used idle trajectory
        ends (its next turn is told). Never another client's: with none of its own idle,
        raises TrajectoriesFull."""
        s = self.settings
        while (mine := self._per_client[client_id]) > s.max_trajectories_per_client or len(
            self._open
        ) > s.max_trajectories:
            share = mine > s.max_trajectories_per_client
            idle = next(
                (t for (c, _), t in self._open.items() if c == client_id and not t.busy), None
            )
            if idle is not None:
                why = "its client's share" if share else "the worker's bound"
                await self._close(idle, ended=f"it was the least recently used at {why}")
            elif share:
                raise TrajectoriesFull(
                    429,
                    f"client {client_id!r} holds its share of {s.max_trajectories_per_client} "
                    "open trajectories on this worker, all mid-turn: end one "
                    "(DELETE /v1/trajectories/{id}) or wait for a turn to be answered",
                    1.0,
                )
            else:
                raise TrajectoriesFull(
                    503,
                    f"this worker holds its bound of {s.max_trajectories} open trajectories, "
                    "none of them this client's to end: retry later, or on another worker",
                    self._next_idle_end_s(),
                )

    def _next_idle_end_s(self) -> float:
        """Seconds until the sweep ends the least recently used idle trajectory (at least 1)."""
        used = min((t.last_used for t in self._open.values() if not t.busy), default=None)
        if used is None:
            return self.settings.trajectory_idle_s
        return max(1.0, used + self.settings.trajectory_idle_s - time.monotonic())

    def _drop(self, session: Session) -> bool:
        """Forget ``session`` if it is the one open under its key; True if it was."""
        key = self._key_of(session)
        if self._open.get(key) is not session:
            return False
        del self._open[key]
        self._per_client[key[0]] -= 1
        if not self._per_client[key[0]]:
            del self._per_client[key[0]]
        return True

    async def _check_not_lost(self, key: tuple[str, str]) -> None:
        """Raise TrajectoryConflict, once, for a trajectory an earlier run or another
        worker was serving: its turns so far are gone."""
        stored = await self._redis.getdel(_owner_key(key))
        owner = stored.decode() if isinstance(stored, bytes) else stored
        if owner is not None and owner.startswith(ENDED):
            raise TrajectoryConflict(
                f"trajectory {key[1]!r} was ended by this worker ({owner.removeprefix(ENDED)}), "
                "and its turns so far were recorded: this trajectory id starts anew on the "
                "next request"
            )
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

    async def _close(self, session: Session, *, ended: str = "") -> None:
        """End ``session`` and write its last link. ``ended``: why the worker ended it to
        make room, told to the trajectory's next turn."""
        if not self._drop(session):
            return
        self.ended += 1
        self._forget(_engine_key(session))
        await self._write(session, final=True)  # first: the record does not wait on Redis
        key = _owner_key(self._key_of(session))
        if ended:
            await self._redis.set(key, ENDED + ended, ex=self._owner_ttl_s)
        else:
            await self._redis.delete(key)

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
    rendered = policy.render(synthetic, tools)
    text = rendered.text
    at = text.find(_MARK)
    if at < 0 or text.find(_MARK, at + 1) >= 0:
        raise ChatTemplateError(
            "the chat template does not render an assistant turn's content as given, so "
            "a trajectory's next turn cannot be told from its history"
        )
    start = at + len(_MARK)
    if last_id in policy.eos_token_ids:
        sampled_end = str(policy.tokenizer.convert_ids_to_tokens(last_id))
        start += len(sampled_end) if text.startswith(sampled_end, start) else 0
    return policy.tokenize(rendered.tail(start))


def _engine_key(session: Session) -> str:
    return f"{session.opening.client_id}/{session.trajectory_id}/{session.position}"


def _owner_key(key: tuple[str, str]) -> str:
    return f"{OWNER_PREFIX}{key[0]}:{key[1]}"
