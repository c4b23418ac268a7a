"""From an engine Completion to the wire: its trajectory and the RolloutRecord."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from rtrl.inference.arms import ARM_ENUM
from rtrl.inference.engine import Completion
from rtrl.inference.model import Routes
from rtrl.moe import pack_routes
from rtrl.trajectory import Segment, Trajectory
from rtrl.trajectory import VersionSpan as VersionSpan
from rtrl.trajectory import version_spans as version_spans
from rtrl.v1 import rollout_pb2

SCHEMA_VERSION = 1


def trajectory_of(completion: Completion, prompt_text: str = "") -> Trajectory:
    """The completion as the prompt and the one segment the engine generated after it."""
    result = completion.result
    return Trajectory.single_turn(
        completion.prompt_ids,
        Segment.generated(result.token_ids, result.logprobs, result.versions),
        final_text=result.text,
        finish_reason=result.finish_reason,
        prompt_text=prompt_text,
    )


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


def rollout_record(context: RolloutContext, completion: Completion) -> rollout_pb2.RolloutRecord:
    result, params = completion.result, completion.params
    record = rollout_pb2.RolloutRecord(
        event_id=str(uuid.uuid4()),
        rollout_id=context.rollout_id,
        session_id=context.session_id,
        client_ts_ms=context.client_ts_ms,
        schema_version=SCHEMA_VERSION,
        user_id=context.user_id,
        worker_id=context.worker_id,
        arm=ARM_ENUM[completion.arm],
        model_name=context.model_name,
        prompt_group_id=context.prompt_group_id,
        context_key=context.context_key,
        sampling=rollout_pb2.SamplingParams(
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=params.max_tokens,
            seed=params.seed,
        ),
        latency_s=completion.latency_s,
        time_to_first_token_s=completion.ttft_s,
        traceparent=context.traceparent,
        client_id=context.client_id,
    )
    trajectory_of(completion, context.prompt_text).write(record)
    routes = result.router_choices
    if routes is not None:
        record.router_choices.CopyFrom(_router_choices(completion, routes))
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
