"""From an engine Completion to the wire: its trajectory and the RolloutRecord."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from rtrl.inference.arms import ARM_ENUM
from rtrl.inference.batch import SequenceParams
from rtrl.inference.engine import Completion
from rtrl.inference.model import Routes
from rtrl.moe import pack_routes
from rtrl.trajectory import Segment, ToolCall, Trajectory
from rtrl.trajectory import VersionSpan as VersionSpan
from rtrl.trajectory import version_spans as version_spans
from rtrl.v1 import rollout_pb2

SCHEMA_VERSION = 1


def trajectory_of(
    completion: Completion,
    prompt_text: str = "",
    *,
    final_text: str | None = None,
    finish_reason: str | None = None,
    tool_calls: tuple[ToolCall, ...] = (),
) -> Trajectory:
    """The completion as the prompt and the one segment the engine generated after it; a
    chat turn that called tools gives its content, its calls and "tool_calls"."""
    result = completion.result
    return Trajectory.single_turn(
        completion.prompt_ids,
        generated_segment(completion),
        final_text=result.text if final_text is None else final_text,
        finish_reason=result.finish_reason if finish_reason is None else finish_reason,
        prompt_text=prompt_text,
        tool_calls=tool_calls,
    )


def generated_segment(completion: Completion) -> Segment:
    result = completion.result
    return Segment.generated(result.token_ids, result.logprobs, result.versions)


@dataclass(frozen=True)
class RolloutContext:
    """What the server knows about a request beyond the engine's completion."""

    rollout_id: str
    session_id: str
    user_id: str
    client_ts_ms: int
    worker_id: str
    model_name: str
    prompt_text: str
    prompt_group_id: str = ""
    context_key: str = ""
    traceparent: str = ""
    client_id: str = ""
    """The client whose API key was served the completion ("" without keys)."""


def rollout_record(
    context: RolloutContext, completion: Completion, trajectory: Trajectory | None = None
) -> rollout_pb2.RolloutRecord:
    """A single-turn completion's record: ``trajectory``, by default the completion's
    (trajectory_of)."""
    record = trajectory_record(
        context,
        trajectory or trajectory_of(completion, context.prompt_text),
        arm=completion.arm,
        params=completion.params,
        latency_s=completion.latency_s,
        ttft_s=completion.ttft_s,
    )
    routes = completion.result.router_choices
    if routes is not None:
        record.router_choices.CopyFrom(_router_choices(completion, routes))
    return record


def trajectory_record(
    context: RolloutContext,
    trajectory: Trajectory,
    *,
    arm: str,
    params: SequenceParams,
    latency_s: float,
    ttft_s: float,
    wall_s: float | None = None,
) -> rollout_pb2.RolloutRecord:
    """The record of ``trajectory`` (one turn, or an agent's link of several). ``wall_s``:
    what the user waited, when more than ``latency_s`` (a link's first request to its last
    answer)."""
    record = rollout_pb2.RolloutRecord(
        event_id=str(uuid.uuid4()),
        rollout_id=context.rollout_id,
        session_id=context.session_id,
        client_ts_ms=context.client_ts_ms,
        schema_version=SCHEMA_VERSION,
        user_id=context.user_id,
        worker_id=context.worker_id,
        arm=ARM_ENUM[arm],
        model_name=context.model_name,
        prompt_group_id=context.prompt_group_id,
        context_key=context.context_key,
        sampling=rollout_pb2.SamplingParams(
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=params.max_tokens,
            seed=params.seed,
        ),
        latency_s=latency_s,
        wall_s=latency_s if wall_s is None else wall_s,
        time_to_first_token_s=ttft_s,
        traceparent=context.traceparent,
        client_id=context.client_id,
    )
    trajectory.write(record)
    return record


def _router_choices(completion: Completion, routes: Routes) -> rollout_pb2.RouterChoices:
    """The routes on the wire. The trainer drops a rollout whose routes miss a position
    its sampler ran, so a wrong count is a bug here, not a rollout to send."""
    ran = len(completion.prompt_ids) + len(completion.result.token_ids) - 1
    if routes.expert_ids.shape[0] != ran:
        raise ValueError(
            f"routes of {routes.expert_ids.shape[0]} positions; the sampler ran {ran} "
            "(prompt + completion - 1)"
        )
    return pack_routes(routes.expert_ids, routes.num_experts)
