"""Protobuf records -> ClickHouse rows. Pure: the sink feeds it, tests call it directly.

A record that does not decode, one holding a value no column can store (a timestamp
outside what ``DateTime`` holds: 2^62, the year 2200, a negative one), and everything on
the dead-letter topic become a ``dead_letters`` row carrying the raw bytes and the
reason, so one bad record never stops the sink: it inserts the row and commits past it.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from google.protobuf.message import DecodeError

from rtrl import topics
from rtrl.analytics import schema
from rtrl.trajectory_summary import Summary
from rtrl.v1 import reward_pb2, rollout_pb2, trainer_pb2
from rtrl_client.v1 import telemetry_pb2

ARM_NAMES = {1: "control", 2: "treatment"}
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# What every timestamp column stores: DateTime64(3) reaches 2299, but the A/B views
# bucket by toStartOfHour into a DateTime, whose range is [1970-01-01, 2106-02-07 06:28:15].
TS_MIN_MS = 0
TS_MAX_MS = (2**32 - 1) * 1000 + 999


class Unstorable(ValueError):
    """A field's value has no column representation; str(exc) is the dead letter's reason."""


COLUMNS: dict[str, tuple[str, ...]] = {
    schema.ROLLOUTS: (
        "rollout_id",
        "event_id",
        "arm",
        "worker_id",
        "user_id",
        "session_id",
        "model_name",
        "prompt_group_id",
        "ts",
        "policy_version_min",
        "policy_version_max",
        "prompt_tokens",
        "completion_tokens",
        "latency_s",
        "time_to_first_token_s",
        "tool_calls",
        "invalid_tool_calls",
        "prompt_text",
        "completion_text",
        "finish_reason",
        "traceparent",
        "context_key",
        "wall_s",
    ),
    schema.TRAJECTORY_LINKS: (
        "rollout_id",
        "trajectory_id",
        "link_position",
        "final",
        "link_reason",
        "arm",
        "model_name",
        "ts",
        "policy_version_min",
        "policy_version_max",
        "versions_spanned",
        "turns",
        "tool_calls",
        "invalid_tool_calls",
        "parallel_turns",
        "tool_names",
        "prompt_tokens",
        "generated_tokens",
        "observed_tokens",
        "finish_reason",
        "tool_name_calls",
        "tool_name_invalid",
    ),
    schema.TELEMETRY: (
        "event_id",
        "rollout_id",
        "session_id",
        "user_id",
        "kind",
        "ts",
        "file_path",
        "edit_text",
        "outcome",
        "seconds_after_edit",
        "region_text",
        "followup_message",
    ),
    schema.REWARDS: (
        "reward_id",
        "rollout_id",
        "topic",
        "arm",
        "policy_version",
        "rollout_ts",
        "completion_tokens",
        "latency_s",
        "persisted_fraction",
        "persistence_observed",
        "dissatisfied",
        "followup_observed",
        "tool_call_validity",
        "effort_penalty",
        "reward",
        "defaulted",
        "reward_fn_version",
        "last_event_ts",
        "settled_ts",
        "event_count",
    ),
    schema.TRAINER_STEPS: (
        "step_id",
        "lineage",
        "step",
        "base_version",
        "version",
        "published",
        "ts",
        "rollouts",
        "tokens",
        "reward_mean",
        "loss",
        "kl",
        "entropy",
        "clipped_fraction",
        "ratio_mean",
        "grad_norm",
        "advantage_abs_mean",
        "staleness",
        "dropped",
        "eval_candidate",
        "eval_published",
        "eval_regressions",
        "batch_wait_s",
        "step_s",
        "eval_s",
        "publish_s",
        "traceparent",
        "mismatch_mean",
        "mismatch_max",
        "mismatch_over_threshold_share",
        "mismatch_tokens",
        "mismatch_threshold",
    ),
    schema.LATE: ("event_id", "rollout_id", "source_topic", "kind", "event_ts", "ingested_ts"),
    schema.DEAD_LETTERS: (
        "topic",
        "partition",
        "offset",
        "key",
        "reason",
        "headers_json",
        "value_b64",
        "ingested_ts",
    ),
}


@dataclass(frozen=True)
class Row:
    """One row for one table, values in ``COLUMNS[table]`` order."""

    table: str
    values: tuple


@dataclass(frozen=True)
class KafkaRecord:
    """What the sink needs of a consumed message."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...] = ()


def ts(ms: int, field: str = "ts_ms") -> datetime:
    """Epoch milliseconds as a UTC datetime, or Unstorable naming ``field`` when out of range."""
    if not TS_MIN_MS <= ms <= TS_MAX_MS:
        raise Unstorable(
            f"{field} {ms} cannot be stored: timestamps must lie in [{TS_MIN_MS}, {TS_MAX_MS}] ms "
            "(1970-01-01 to 2106-02-07 UTC)"
        )
    return _EPOCH + timedelta(milliseconds=ms)


def arm_name(arm: int) -> str:
    return ARM_NAMES.get(arm, "unspecified")


def convert_all(record: KafkaRecord, now_ms: int) -> list[Row]:
    """The record's rows: its table's, and an agent's rollout's link in trajectory_links."""
    if record.topic == topics.ROLLOUT:
        try:
            rollout = rollout_pb2.RolloutRecord.FromString(record.value or b"")
            rows = [rollout_row(rollout)]
            if rollout.HasField("link"):
                rows.append(trajectory_row(rollout))
            return rows
        except DecodeError as exc:
            return [dead_letter(record, f"does not decode as the topic's message: {exc}", now_ms)]
        except Unstorable as exc:
            return [dead_letter(record, str(exc), now_ms)]
    return [convert(record, now_ms)]


def convert(record: KafkaRecord, now_ms: int) -> Row:
    if record.topic == topics.REWARD_DLQ:
        return dead_letter(record, "on the dead-letter topic (see headers)", now_ms)
    try:
        value = record.value or b""
        if record.topic == topics.ROLLOUT:
            return rollout_row(rollout_pb2.RolloutRecord.FromString(value))
        if record.topic == topics.REWARD:
            return reward_row(reward_pb2.RewardRecord.FromString(value), record.topic)
        if record.topic == topics.REWARD_LATE:
            return late_row(record, now_ms)
        if record.topic in (topics.EDIT, topics.PERSISTENCE, topics.FOLLOWUP):
            return telemetry_row(telemetry_pb2.TelemetryEvent.FromString(value))
        if record.topic == topics.TRAINER_STEPS:
            return trainer_step_row(trainer_pb2.TrainerStep.FromString(value))
    except DecodeError as exc:
        return dead_letter(record, f"does not decode as the topic's message: {exc}", now_ms)
    except Unstorable as exc:
        return dead_letter(record, str(exc), now_ms)
    return dead_letter(record, "topic has no table", now_ms)


def late_row(record: KafkaRecord, now_ms: int) -> Row:
    """An input the joiner set aside on rl.reward.v1.late: the record as it was read
    (a RolloutRecord or a TelemetryEvent, per its ``source_topic`` header)."""
    headers = {name: (value or b"").decode("utf-8", "replace") for name, value in record.headers}
    source = headers.get("source_topic", "")
    message: rollout_pb2.RolloutRecord | telemetry_pb2.TelemetryEvent
    if source == topics.ROLLOUT:
        message = rollout_pb2.RolloutRecord.FromString(record.value or b"")
        event_ts = message.client_ts_ms
    elif source in (topics.EDIT, topics.PERSISTENCE, topics.FOLLOWUP):
        message = telemetry_pb2.TelemetryEvent.FromString(record.value or b"")
        event_ts = message.client_ts_ms
    else:
        return dead_letter(record, f"late record from unknown source_topic {source!r}", now_ms)
    return Row(
        schema.LATE,
        (
            message.event_id,
            message.rollout_id,
            source,
            headers.get("kind", ""),
            ts(event_ts, "client_ts_ms"),
            ts(now_ms),
        ),
    )


def version_range(summary: Summary) -> tuple[int, int]:
    """(min, max) policy version that sampled the rollout; (-1, -1) when it names none."""
    return summary.version_range() or (-1, -1)


def rollout_row(r: rollout_pb2.RolloutRecord) -> Row:
    summary = Summary.of(r)
    low, high = version_range(summary)
    return Row(
        schema.ROLLOUTS,
        (
            r.rollout_id,
            r.event_id,
            arm_name(r.arm),
            r.worker_id,
            r.user_id,
            r.session_id,
            r.model_name,
            r.prompt_group_id,
            ts(r.client_ts_ms, "client_ts_ms"),
            low,
            high,
            summary.prompt_tokens,
            summary.generated_tokens,
            r.latency_s,
            r.time_to_first_token_s,
            summary.tool_call_count,
            summary.invalid_tool_calls,
            summary.prompt_text,
            summary.final_text,
            summary.finish_reason,
            r.traceparent,
            r.context_key,
            r.wall_s or r.latency_s,
        ),
    )


def trajectory_row(r: rollout_pb2.RolloutRecord) -> Row:
    """An agent's link: its turns, its tool calls by name and validity, the turns that
    called tools in parallel, generated against observed tokens, versions spanned."""
    summary = Summary.of(r)
    low, high = version_range(summary)
    link = summary.link
    assert link is not None  # convert_all asks for this row only for a linked record
    return Row(
        schema.TRAJECTORY_LINKS,
        (
            r.rollout_id,
            link.trajectory_id,
            link.position,
            link.final,
            str(link.reason),
            arm_name(r.arm),
            r.model_name,
            ts(r.client_ts_ms, "client_ts_ms"),
            low,
            high,
            len(summary.version_tokens),
            summary.turns,
            summary.tool_call_count,
            summary.invalid_tool_calls,
            summary.parallel_turns,
            [c.name for c in summary.tool_counts],
            summary.prompt_tokens,
            summary.generated_tokens,
            summary.observed_tokens,
            summary.finish_reason,
            [c.calls for c in summary.tool_counts],
            [c.invalid for c in summary.tool_counts],
        ),
    )


def telemetry_row(e: telemetry_pb2.TelemetryEvent) -> Row:
    kind = e.WhichOneof("payload") or "none"
    outcome = ""
    if kind == "edit_outcome":
        outcome = (
            telemetry_pb2.EditOutcome.Outcome.Name(e.edit_outcome.outcome)
            if e.edit_outcome.outcome in (0, 1, 2)
            else str(e.edit_outcome.outcome)
        )
    seconds_after_edit = (
        e.persistence.seconds_after_edit if kind == "persistence" else e.followup.seconds_after_edit
    )
    return Row(
        schema.TELEMETRY,
        (
            e.event_id,
            e.rollout_id,
            e.session_id,
            e.user_id,
            kind,
            ts(e.client_ts_ms, "client_ts_ms"),
            e.edit_shown.file_path,
            e.edit_shown.edit_text,
            outcome,
            seconds_after_edit,
            e.persistence.region_text,
            e.followup.message,
        ),
    )


def reward_row(rec: reward_pb2.RewardRecord, topic: str) -> Row:
    rollout, parts = rec.rollout, rec.components
    summary = Summary.of(rollout)
    _, policy_version = version_range(summary)
    return Row(
        schema.REWARDS,
        (
            rec.reward_id,
            rec.rollout_id,
            topic,
            arm_name(rollout.arm),
            policy_version,
            ts(rollout.client_ts_ms, "rollout.client_ts_ms"),
            summary.generated_tokens,
            parts.latency_s or rollout.latency_s,
            parts.persisted_fraction,
            parts.persistence_observed,
            parts.dissatisfied,
            parts.followup_observed,
            parts.tool_call_validity,
            parts.effort_penalty,
            rec.reward,
            rec.defaulted,
            rec.reward_fn_version,
            ts(rec.last_event_ts_ms, "last_event_ts_ms"),
            ts(rec.settled_ts_ms, "settled_ts_ms"),
            len(rec.event_ids),
        ),
    )


def trainer_step_row(step: trainer_pb2.TrainerStep) -> Row:
    return Row(
        schema.TRAINER_STEPS,
        (
            step.step_id,
            step.lineage,
            step.step,
            step.base_version,
            step.version,
            step.published,
            ts(step.ts_ms, "ts_ms"),
            step.rollouts,
            step.tokens,
            step.reward_mean,
            step.loss,
            step.kl,
            step.entropy,
            step.clipped_fraction,
            step.ratio_mean,
            step.grad_norm,
            step.advantage_abs_mean,
            {bucket.staleness: bucket.rollouts for bucket in step.staleness},
            dict(step.dropped),
            dict(step.eval_candidate),
            dict(step.eval_published),
            list(step.eval_regressions),
            step.batch_wait_s,
            step.step_s,
            step.eval_s,
            step.publish_s,
            step.traceparent,
            step.mismatch_mean,
            step.mismatch_max,
            step.mismatch_over_threshold_share,
            step.mismatch_tokens,
            step.mismatch_threshold,
        ),
    )


def dead_letter(record: KafkaRecord, reason: str, now_ms: int) -> Row:
    headers = {name: (value or b"").decode("utf-8", "replace") for name, value in record.headers}
    return Row(
        schema.DEAD_LETTERS,
        (
            record.topic,
            record.partition,
            record.offset,
            (record.key or b"").decode("utf-8", "replace"),
            reason,
            json.dumps(headers, sort_keys=True),
            base64.b64encode(record.value or b"").decode(),
            ts(now_ms),
        ),
    )
