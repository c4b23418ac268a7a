"""From an engine Completion to the wire: version spans and the RolloutRecord."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from rtrl.inference.arms import ARM_ENUM
from rtrl.inference.engine import Completion
from rtrl.inference.model import Routes
from rtrl.moe import pack_routes
from rtrl.v1 import rollout_pb2

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class VersionSpan:
    """Completion tokens [start, end) were sampled by policy version ``version``."""

    version: int
    start: int
    end: int


def version_spans(versions: tuple[int, ...] | list[int]) -> list[VersionSpan]:
    """Runs of equal versions, in token order."""
    spans: list[VersionSpan] = []
    start = 0
    for i in range(1, len(versions) + 1):
        if i == len(versions) or versions[i] != versions[start]:
            spans.append(VersionSpan(versions[start], start, i))
            start = i
    return spans


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
        prompt_token_ids=completion.prompt_ids,
        completion_token_ids=result.token_ids,
        completion_logprobs=result.logprobs,
        version_spans=[
            rollout_pb2.VersionSpan(policy_version=s.version, start=s.start, end=s.end)
            for s in version_spans(result.versions)
        ],
        sampling=rollout_pb2.SamplingParams(
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=params.max_tokens,
            seed=params.seed,
        ),
        latency_s=completion.latency_s,
        time_to_first_token_s=completion.ttft_s,
        prompt_text=context.prompt_text,
        completion_text=result.text,
        finish_reason=result.finish_reason,
        traceparent=context.traceparent,
        client_id=context.client_id,
    )
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
