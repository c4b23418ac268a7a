"""The HTTP contract of ``POST /v1/completions`` and ``POST /v1/chat/completions``: the
request bodies and the answers.

OpenAI-shaped where that is natural (``choices[0].text`` / ``choices[0].message``,
``usage``), plus what the product needs: the rollout id it reports telemetry against,
the arm, and the policy versions that produced the text. A chat request's messages are
rendered by the checkpoint's chat template into token ids once, at the server; the
rollout record holds exactly those ids and the sampled ones.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rtrl.event_time import EventTimeWindow
from rtrl.field_bounds import GROUP_ID, MAX_ID_CHARS
from rtrl.inference.chat_messages import ChatMessage, NamedToolChoice, Tool
from rtrl.inference.engine import Completion
from rtrl.inference.records import trajectory_of

CONTEXT_KEY = re.compile(r"[A-Za-z0-9._:/@-]{0,128}")
"""What a request's context_key may hold: ASCII letters, digits and ``._:/@-``, at most 128
of them. It becomes a key of the trainer's running means and an analytics column."""

TRAJECTORY_ID = r"^[A-Za-z0-9._:@-]{1,128}$"
"""What a trajectory id may be: it is part of a path and a Redis key."""


class FieldRefused(ValueError):
    """A request field outside what the server accepts; answered 400 naming the field."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field


class RequestBody(BaseModel):
    """What both endpoints take besides the prompt. Unknown fields (``model``, ``n``...)
    are ignored. Nothing beyond what an OpenAI client sends is required: the end user is
    rtrl's ``user_id``, else OpenAI's ``user``, else the API key's client (``end_user``)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    user_id: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS)
    """The end user; the gateway takes events about the rollout only under the same bound."""
    user: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS)
    """OpenAI's name for the end user."""
    session_id: str = Field("", max_length=MAX_ID_CHARS)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=5)
    top_p: float | None = Field(None, gt=0, le=1)
    arm: Literal["control", "treatment"] | None = None
    privacy_mode: bool = False
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    client_ts_ms: int | None = None
    """The product's clock when it asked; absent means the server's. Bounded by ``check_client_ts``."""
    prompt_group_id: str = ""
    """The product's group of rollouts with one prompt, matching field_bounds.GROUP_ID; copied
    into the rollout, its reward and the analytics sink, so bounded at the door."""
    context_key: str = ""
    """The product's context of the request (task type, repository...), matching CONTEXT_KEY;
    the trainer's context baseline compares the rollout's reward with that context's."""
    stream: bool = False
    """Server-sent events: a chunk per token as it is sampled, then the whole answer."""

    @field_validator("context_key")
    @classmethod
    def _context_key_allowed(cls, value: str) -> str:
        if CONTEXT_KEY.fullmatch(value) is None:
            raise ValueError("at most 128 of the characters A-Z a-z 0-9 . _ : / @ -")
        return value

    @field_validator("prompt_group_id")
    @classmethod
    def _prompt_group_id_allowed(cls, value: str) -> str:
        if GROUP_ID.fullmatch(value) is None:
            raise ValueError("at most 128 of the characters A-Z a-z 0-9 . _ : / @ -")
        return value

    def check_client_ts(self, now_ms: int, window: EventTimeWindow) -> None:
        """Raise FieldRefused unless client_ts_ms (when given) lies in ``window`` around ``now_ms``:
        the rollout's event time drives the joiner's stream time downstream."""
        if self.client_ts_ms is not None and (
            problem := window.problem(self.client_ts_ms, now_ms, "server clock")
        ):
            raise FieldRefused("client_ts_ms", problem)

    def end_user(self, client_id: str | None) -> str:
        """Who the completion is for (their arm, their privacy): ``user_id``, else ``user``,
        else the API key's client. Raises FieldRefused when the request names nobody and
        came without a key."""
        user = self.user_id or self.user or client_id
        if not user:
            raise FieldRefused(
                "user", "name the end user (OpenAI's user field), or send an API key"
            )
        return user

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(s for s in self.stop if s)


class CompletionBody(RequestBody):
    """``POST /v1/completions``: a plain prompt, tokenized as the checkpoint's tokenizer
    does, or the token ids themselves (token in, token out)."""

    prompt: str | list[Annotated[int, Field(ge=0)]]


class ChatBody(RequestBody):
    """``POST /v1/chat/completions``: messages for the checkpoint's chat template, the tools
    the policy may call, and the agent's trajectory when the turn continues one."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    tools: list[Tool] | None = Field(None, max_length=512)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    trajectory_id: str | None = Field(None, pattern=TRAJECTORY_ID)
    """Ties this turn to the earlier turns of one agent's trajectory (inference/sessions.py);
    also taken from the path (``/v1/trajectories/{id}/chat/completions``)."""

    @field_validator("tool_choice")
    @classmethod
    def _policy_chooses(cls, value: object) -> object:
        if value not in (None, "none", "auto"):
            raise ValueError(
                "rtrl serves tool_choice auto and none: the policy decides whether to call a "
                "tool (a forced call would not be the policy's own rollout to train on)"
            )
        return value

    def offered_tools(self) -> list[Tool]:
        """The tools the policy is shown and may call: none under tool_choice "none"."""
        return [] if self.tool_choice == "none" else list(self.tools or ())


@dataclass(frozen=True)
class Turn:
    """An assistant turn as answered: its text outside the calls and the calls, in
    OpenAI's shape (ids included)."""

    content: str
    tool_calls: list[dict[str, Any]]
    finish_reason: str

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["content"] = self.content or None
            message["tool_calls"] = self.tool_calls
        return message


def chat_response(
    rollout_id: str, model_name: str, completion: Completion, latency_s: float, turn: Turn
) -> dict[str, Any]:
    """The chat answer: the completion's fields, the turn as the assistant's message."""
    answer = completion_response(rollout_id, model_name, completion, latency_s)
    answer["object"] = "chat.completion"
    answer["text"] = turn.content
    answer["finish_reason"] = turn.finish_reason
    answer["choices"] = [
        {
            "index": 0,
            "message": turn.message(),
            "finish_reason": turn.finish_reason,
            "logprobs": None,
        }
    ]
    return answer


def completion_response(
    rollout_id: str, model_name: str, completion: Completion, latency_s: float
) -> dict[str, Any]:
    trajectory = trajectory_of(completion)
    prompt, generated = trajectory.prompt_ids, trajectory.generated_ids
    usage = {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(generated),
        "total_tokens": len(prompt) + len(generated),
    }
    return {
        "id": rollout_id,
        "rollout_id": rollout_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "arm": completion.arm,
        "text": trajectory.final_text,
        "finish_reason": trajectory.finish_reason,
        "choices": [
            {
                "index": 0,
                "text": trajectory.final_text,
                "finish_reason": trajectory.finish_reason,
                "logprobs": None,
            }
        ],
        "policy_versions": [
            {"version": s.version, "start": s.start, "end": s.end}
            for s in trajectory.version_spans()
        ],
        "usage": usage,
        "prompt_token_ids": list(prompt),
        "token_ids": list(generated),
        "seed": completion.params.seed,
        "ttft_s": completion.ttft_s,
        "latency_s": latency_s,
    }
