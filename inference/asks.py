"""A completion request as the engine will run it (``Ask``): its body checked, the
server's defaults filled in, the arm assigned, and the token ids the model sees: the chat
template's rendering, the prompt's tokens or ids, or, for a turn of an agent's
trajectory, the trajectory's ids and the new messages' (inference/sessions.py)."""

from __future__ import annotations

import asyncio
import re
import uuid
from dataclasses import dataclass, replace

from aiohttp import web

from rtrl.api_keys import ApiKey
from rtrl.checkpoint import ChatTemplateError, Checkpoint
from rtrl.inference.api import TRAJECTORY_ID, ChatBody, CompletionBody, FieldRefused, RequestBody
from rtrl.inference.arms import assign_arm
from rtrl.inference.chat_messages import Tool
from rtrl.inference.config import InferenceSettings
from rtrl.inference.recording import KeptFromTraining, kept_from_training
from rtrl.inference.session_state import Opening, Plan
from rtrl.inference.sessions import Sessions


@dataclass(frozen=True)
class Ask:
    """A request's body, checked, with the server's defaults filled in and the arm assigned."""

    body: RequestBody
    chat: bool
    prompt_ids: list[int]
    max_tokens: int
    user_id: str
    """The end user (RequestBody.end_user)."""
    arm: str
    temperature: float
    top_p: float
    client_ts_ms: int
    """The body's, or the server's clock when it arrived."""
    kept: KeptFromTraining | None
    """Why its completion will not be recorded, when that is known before it is generated."""
    rollout_id: str
    tools: list[Tool] | None
    """The tools the policy was shown (None: the request had no ``tools``)."""
    plan: Plan | None = None
    """A turn of an agent's trajectory: what it generates from (inference/sessions.py)."""


class Asks:
    """Reads requests into Asks, for one worker."""

    def __init__(self, settings: InferenceSettings, policy: Checkpoint, sessions: Sessions) -> None:
        self.settings = settings
        self.policy = policy
        self.sessions = sessions
        self.client_ts_window = settings.client_ts_window()

    async def parse(
        self,
        request: web.Request,
        raw: bytes,
        received_ms: int,
        key: ApiKey | None,
        traceparent: str,
    ) -> Ask:
        """The request as the engine will run it. Raises ValueError (pydantic's
        ValidationError, FieldRefused naming the field) for a body the server refuses, and
        TrajectoryConflict for a turn its trajectory cannot take."""
        chat = request.path.endswith("/chat/completions")
        body: RequestBody = (ChatBody if chat else CompletionBody).model_validate_json(raw)
        user_id = body.end_user(key.client_id if key is not None else None)
        body.check_client_ts(received_ms, self.client_ts_window)
        s = self.settings
        temperature = s.temperature if body.temperature is None else body.temperature
        top_p = body.top_p or s.top_p
        ask = Ask(
            body=body,
            chat=chat,
            prompt_ids=[],
            max_tokens=body.max_tokens or s.max_tokens,
            user_id=user_id,
            arm=body.arm or assign_arm(user_id, s.treatment_fraction),
            temperature=temperature,
            top_p=top_p,
            client_ts_ms=received_ms if body.client_ts_ms is None else body.client_ts_ms,
            kept=kept_from_training(s, body, temperature, top_p),
            rollout_id=str(uuid.uuid4()),
            tools=body.offered_tools() if isinstance(body, ChatBody) and body.tools else None,
        )
        trajectory_id = _trajectory_id(request, body)
        if trajectory_id is None:
            return replace(ask, prompt_ids=await self.prompt_ids(body, ask.tools))
        assert isinstance(body, ChatBody)
        try:
            plan = await self.sessions.plan(
                client_of(key),
                trajectory_id,
                body.messages,
                ask.tools or [],
                _opening(ask, key, traceparent),
                named_user=body.user_id or body.user,
                named_arm=body.arm,
            )
        except ChatTemplateError as exc:
            raise FieldRefused("messages", str(exc)) from None
        # The trajectory's own: every turn of one rollout sampled by the arm it credits.
        opening = plan.session.opening
        return replace(
            ask,
            prompt_ids=plan.prompt_ids,
            plan=plan,
            rollout_id=opening.rollout_id,
            user_id=opening.user_id,
            arm=opening.arm,
        )

    async def prompt_ids(self, body: RequestBody, tools: list[Tool] | None) -> list[int]:
        """The token ids the model sees: the chat template's rendering of the messages (and
        the tools offered), the prompt's tokens, or the prompt's ids as given (checked
        against the vocabulary). Raises FieldRefused naming the field. The template renders
        in a thread, within its bounds (rtrl/chat_template.py): the event loop goes on
        serving meanwhile."""
        if isinstance(body, ChatBody):
            messages = [m.template_message() for m in body.messages]
            template_tools = [t.template_tool() for t in tools or ()]
            try:
                return await asyncio.to_thread(self.policy.render_chat, messages, template_tools)
            except ChatTemplateError as exc:
                raise FieldRefused("messages", str(exc)) from None
        assert isinstance(body, CompletionBody)
        if isinstance(body.prompt, list):
            vocab = self.policy.spec.vocab_size
            if any(i >= vocab for i in body.prompt):
                raise FieldRefused("prompt", f"token ids must be below the vocabulary's {vocab}")
            return list(body.prompt)
        try:
            return self.policy.encode(body.prompt)
        except ValueError as exc:
            raise FieldRefused("prompt", str(exc)) from None


def _trajectory_id(request: web.Request, body: RequestBody) -> str | None:
    """The trajectory a chat turn continues: from the path or the body (not two)."""
    in_path = request.match_info.get("trajectory_id")
    in_body = body.trajectory_id if isinstance(body, ChatBody) else None
    if in_path is not None and not isinstance(body, ChatBody):
        raise FieldRefused("prompt", "a trajectory's turns are chats: /chat/completions")
    if in_path is not None and in_body is not None and in_path != in_body:
        raise FieldRefused("trajectory_id", f"the path names {in_path!r}, the body {in_body!r}")
    if in_path is not None and re.fullmatch(TRAJECTORY_ID, in_path) is None:
        raise FieldRefused("trajectory_id", f"must match {TRAJECTORY_ID}")
    return in_path or in_body


def client_of(key: ApiKey | None) -> str:
    return key.client_id if key is not None else ""


def _opening(ask: Ask, key: ApiKey | None, traceparent: str) -> Opening:
    return Opening(
        rollout_id=ask.rollout_id,
        client_id=client_of(key),
        key=key,
        user_id=ask.user_id,
        arm=ask.arm,
        session_id=ask.body.session_id,
        traceparent=traceparent,
        client_ts_ms=ask.client_ts_ms,
        prompt_group_id=ask.body.prompt_group_id,
        context_key=ask.body.context_key,
    )
