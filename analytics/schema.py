"""ClickHouse tables of the analytics sink. The same DDL runs on chdb and on a server.

Every table is a ReplacingMergeTree ordered by its id, so a record the sink writes
twice (a replay after a crash between insert and offset commit) collapses into one
row at merge time. Merges are lazy: queries that count must use ``FINAL`` or
``count(DISTINCT id)``.
"""

from __future__ import annotations

ROLLOUTS = "rollouts"
TELEMETRY = "telemetry_events"
REWARDS = "rewards"
DEAD_LETTERS = "dead_letters"
TRAINER_STEPS = "trainer_steps"

DDL = (
    f"""
CREATE TABLE IF NOT EXISTS {ROLLOUTS} (
    rollout_id String,
    event_id String,
    arm LowCardinality(String),
    worker_id String,
    user_id String,
    session_id String,
    model_name LowCardinality(String),
    prompt_group_id String,
    ts DateTime64(3, 'UTC'),
    policy_version_min Int64,
    policy_version_max Int64,
    prompt_tokens UInt32,
    completion_tokens UInt32,
    latency_s Float64,
    time_to_first_token_s Float64,
    tool_calls UInt32,
    invalid_tool_calls UInt32,
    prompt_text String,
    completion_text String,
    finish_reason LowCardinality(String),
    traceparent String
) ENGINE = ReplacingMergeTree ORDER BY rollout_id
""",
    f"""
CREATE TABLE IF NOT EXISTS {TELEMETRY} (
    event_id String,
    rollout_id String,
    session_id String,
    user_id String,
    kind LowCardinality(String),
    ts DateTime64(3, 'UTC'),
    file_path String,
    edit_text String,
    outcome LowCardinality(String),
    seconds_after_edit Float64,
    region_text String,
    followup_message String
) ENGINE = ReplacingMergeTree ORDER BY event_id
""",
    f"""
CREATE TABLE IF NOT EXISTS {REWARDS} (
    reward_id String,
    rollout_id String,
    topic LowCardinality(String),
    arm LowCardinality(String),
    policy_version Int64,
    rollout_ts DateTime64(3, 'UTC'),
    completion_tokens UInt32,
    latency_s Float64,
    persisted_fraction Float64,
    persistence_observed Bool,
    dissatisfied Float64,
    followup_observed Bool,
    tool_call_validity Float64,
    effort_penalty Float64,
    reward Float64,
    defaulted Bool,
    reward_fn_version LowCardinality(String),
    last_event_ts DateTime64(3, 'UTC'),
    settled_ts DateTime64(3, 'UTC'),
    event_count UInt32
) ENGINE = ReplacingMergeTree ORDER BY (topic, reward_id)
""",
    f"""
CREATE TABLE IF NOT EXISTS {DEAD_LETTERS} (
    topic LowCardinality(String),
    partition UInt32,
    offset Int64,
    key String,
    reason String,
    headers_json String,
    value_b64 String,
    ingested_ts DateTime64(3, 'UTC')
) ENGINE = ReplacingMergeTree ORDER BY (topic, partition, offset)
""",
    f"""
CREATE TABLE IF NOT EXISTS {TRAINER_STEPS} (
    step_id String,
    lineage LowCardinality(String),
    step UInt32,
    base_version Int64,
    version Int64,
    published Bool,
    ts DateTime64(3, 'UTC'),
    rollouts UInt32,
    tokens UInt32,
    reward_mean Float64,
    loss Float64,
    kl Float64,
    entropy Float64,
    clipped_fraction Float64,
    ratio_mean Float64,
    grad_norm Float64,
    advantage_abs_mean Float64,
    staleness Map(Int64, UInt32),
    dropped Map(String, UInt64),
    eval_candidate Map(String, Float64),
    eval_published Map(String, Float64),
    eval_regressions Array(String),
    batch_wait_s Float64,
    step_s Float64,
    eval_s Float64,
    publish_s Float64,
    traceparent String
) ENGINE = ReplacingMergeTree ORDER BY step_id
""",
)


def create_tables(client) -> None:
    """Idempotent: safe on every start-up."""
    for statement in DDL:
        client.command(statement)
