"""ClickHouse tables of the analytics sink. The same DDL runs on chdb and on a server.

Every table is a ReplacingMergeTree ordered by its id, so a record the sink writes
twice (a replay after a crash between insert and offset commit) collapses into one
row at merge time. Merges are lazy: queries that count must use ``FINAL`` or
``count(DISTINCT id)``.

The A/B views. Two materialized views keep the A/B metrics per arm, policy version
(the highest version among the rollout's spans) and hour of the rollout's event time:
``ab_rewards_hourly`` from ``rewards`` (the record on rl.reward.v1 carries the arm, the
version and every component) and ``ab_rollouts_hourly`` from ``rollouts`` (every served
rollout, rewarded yet or not: counts, latency, clarifying questions).

A view fires on every INSERT into its source and aggregates the inserted block, not
the table, so a replayed row arrives a second time. Anything built on sum or count
(sumState, countState, SummingMergeTree, quantileState) would count it twice, and the
target's merges cannot undo that: they combine states, they do not see rows. A state
a duplicate cannot change has to be idempotent (merging x with x gives x), like a set
or a maximum, and an exact count or mean over a set needs the set's members. So each
view keeps one state per (arm, version, hour): ``maxMap`` keyed by the source's dedup
id (reward_id, rollout_id) with one value array per metric, i.e. the map
id -> (values). A replay re-inserts the same id with the same values and the max
leaves them as they were; counts are the number of keys, rates the mean of a 0/1
value, means the mean of a value, quantiles exact over the values. Counts and rates
come from the same keys, so a rate's numerator and denominator are always the same
rewards. uniqExactState(id) would dedup the counts but not the means; one map keeps
both. The price is storage: 8 bytes per value per id plus the id, i.e. the view
pre-groups the data (read by (arm, version, hour) range, no FINAL) rather than shrinking it.
Should one id come back with different values (the deterministic reward_id rules that
out for a reward), the view keeps each value's maximum where the table keeps the last row.

The targets are AggregatingMergeTree ordered by (arm, policy_version, hour); read them
with ``maxMapMerge(by_id)`` grouped by that key or a coarser one, such as version buckets
over all hours (analytics.report): the merged map still holds each id once.

A view only sees inserts made after it exists. ``create_tables`` therefore backfills a
target from its source when it creates the view or finds its target empty: the same
SELECT over the whole source table. The states make that overlap harmless: rows the
view and the backfill both saw, or two sinks backfilling at once, count once.
"""

from __future__ import annotations

from dataclasses import dataclass

from rtrl import topics

ROLLOUTS = "rollouts"
TELEMETRY = "telemetry_events"
REWARDS = "rewards"
DEAD_LETTERS = "dead_letters"
LATE = "late_records"
TRAINER_STEPS = "trainer_steps"
TRAJECTORY_LINKS = "trajectory_links"
"""An agent's trajectory, one row per link of its chain (its RolloutRecord's Link)."""
AB_REWARDS = "ab_rewards_hourly"
AB_ROLLOUTS = "ab_rollouts_hourly"

PERSISTED_THRESHOLD = 0.999
# reward_stream.monitors.is_clarifying_question in SQL: ends with "?" and holds no code
# (signals.has_code: a ``` fence or a line indented by a tab or 2+ spaces). After the "?"
# only ASCII whitespace is skipped, where Python's strip() also skips Unicode spaces.
CLARIFYING_QUESTION = (
    r"match(completion_text, '\\?\\s*$') AND position(completion_text, '```') = 0 "
    r"AND NOT match(completion_text, '(?m)^(\\t| {2,})\\S')"
)

# Per-id values kept by the A/B views, in the order of their value arrays (name -> source
# expression). Each is read back as its mean, except latency_s, read as quantiles.
REWARD_VALUES = {
    "persisted_rate": f"persistence_observed AND persisted_fraction >= {PERSISTED_THRESHOLD}",
    "dissatisfied_rate": "dissatisfied > 0",
    "followup_rate": "followup_observed",
    "defaulted_rate": "defaulted",
    "reward_mean": "reward",
    "persisted_fraction": "persisted_fraction",
    "dissatisfied": "dissatisfied",
    "tool_call_validity": "tool_call_validity",
    "effort_penalty": "effort_penalty",
}
ROLLOUT_VALUES = {
    "clarifying_question_rate": CLARIFYING_QUESTION,
    "latency_s": "wall_s",
}

# Columns a table gained after it was first created. CREATE TABLE IF NOT EXISTS leaves a
# table an older sink made as it was (analytics survive `rtrl down`/`up`), so create_tables
# adds these to it, which is a no-op where the CREATE already made them. Only ever appended,
# like the proto fields they hold.
ADDED_COLUMNS: dict[str, tuple[tuple[str, str], ...]] = {
    # wall_s: what the user waited (a trajectory's tool time included; latency_s for a record
    # older than the field). The A/B latency is read from it.
    ROLLOUTS: (("context_key", "String"), ("wall_s", "Float64")),
    # tool_names became each name once (it was every call's, beside tool_valid, which is
    # no longer written): a record whose bulk is out of band carries counts per name.
    TRAJECTORY_LINKS: (
        ("tool_name_calls", "Array(UInt32)"),
        ("tool_name_invalid", "Array(UInt32)"),
    ),
    TRAINER_STEPS: (
        ("mismatch_mean", "Float64"),
        ("mismatch_max", "Float64"),
        ("mismatch_over_threshold_share", "Float64"),
        ("mismatch_tokens", "UInt32"),
        ("mismatch_threshold", "Float64"),
    ),
}


def _added(table: str) -> str:
    return "".join(f",\n    {name} {kind}" for name, kind in ADDED_COLUMNS[table])


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
    traceparent String{_added(ROLLOUTS)}
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
    # rl.reward.v1.late: inputs that arrived after their rollout settled (the records
    # themselves are in rollouts / telemetry_events already). One row per input, so a
    # joiner that writes one again after a crash does not count it twice.
    f"""
CREATE TABLE IF NOT EXISTS {LATE} (
    event_id String,
    rollout_id String,
    source_topic LowCardinality(String),
    kind LowCardinality(String),
    event_ts DateTime64(3, 'UTC'),
    ingested_ts DateTime64(3, 'UTC')
) ENGINE = ReplacingMergeTree ORDER BY (source_topic, event_id)
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
    traceparent String{_added(TRAINER_STEPS)}
) ENGINE = ReplacingMergeTree ORDER BY step_id
""",
    f"""
CREATE TABLE IF NOT EXISTS {TRAJECTORY_LINKS} (
    rollout_id String,
    trajectory_id String,
    link_position UInt32,
    final Bool,
    link_reason LowCardinality(String),
    arm LowCardinality(String),
    model_name LowCardinality(String),
    ts DateTime64(3, 'UTC'),
    policy_version_min Int64,
    policy_version_max Int64,
    versions_spanned UInt32,
    turns UInt32,
    tool_calls UInt32,
    invalid_tool_calls UInt32,
    parallel_turns UInt32,
    tool_names Array(String),
    tool_valid Array(UInt8),
    prompt_tokens UInt32,
    generated_tokens UInt32,
    observed_tokens UInt32,
    finish_reason LowCardinality(String){_added(TRAJECTORY_LINKS)}
) ENGINE = ReplacingMergeTree ORDER BY (rollout_id, link_position)
""",
)


@dataclass(frozen=True)
class View:
    """A materialized view into an AggregatingMergeTree target, and the SELECT that both
    the view (over each inserted block) and the backfill (over the whole source) run."""

    name: str
    target: str
    target_ddl: str
    select: str

    @property
    def ddl(self) -> str:
        return (
            f"CREATE MATERIALIZED VIEW IF NOT EXISTS {self.name} TO {self.target} AS {self.select}"
        )


def _ab_view(
    target: str,
    source: str,
    id_column: str,
    version: str,
    ts: str,
    values: dict[str, str],
    where: str = "",
) -> View:
    """The view of one source per (arm, policy_version, hour): ``by_id`` is the maxMap state
    id -> one Float64 per entry of ``values``."""
    arrays = ", ".join(f"[toFloat64({expression})]" for expression in values.values())
    select = (
        f"SELECT arm, {version} AS policy_version, toStartOfHour({ts}) AS hour, "
        f"maxMapState([{id_column}], {arrays}) AS by_id "
        f"FROM {source}{where} GROUP BY arm, policy_version, hour"
    )
    target_ddl = f"""
CREATE TABLE IF NOT EXISTS {target} (
    arm LowCardinality(String),
    policy_version Int64,
    hour DateTime('UTC'),
    by_id AggregateFunction(maxMap, Array(String), {", ".join("Array(Float64)" for _ in values)})
) ENGINE = AggregatingMergeTree ORDER BY (arm, policy_version, hour)
"""
    return View(f"{target}_mv", target, target_ddl, select)


VIEWS = (
    _ab_view(
        AB_REWARDS,
        REWARDS,
        "reward_id",
        "policy_version",
        "rollout_ts",
        REWARD_VALUES,
        f" WHERE topic = '{topics.REWARD}'",
    ),
    _ab_view(AB_ROLLOUTS, ROLLOUTS, "rollout_id", "policy_version_max", "ts", ROLLOUT_VALUES),
)


def create_tables(client) -> None:
    """Idempotent: safe on every start-up."""
    for statement in DDL:
        client.command(statement)
    for table, columns in ADDED_COLUMNS.items():
        for name, kind in columns:
            client.command(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {name} {kind}")
    for view in VIEWS:
        client.command(view.target_ddl)
        created = not int(client.command(f"EXISTS TABLE {view.name}"))
        client.command(view.ddl)
        # Also when the target is empty: a crash between creating the view and its backfill.
        if created or not int(client.command(f"SELECT count() FROM {view.target}")):
            backfill(client, view)


def backfill(client, view: View) -> None:
    """Aggregate the whole source table into the view's target. Duplicate-safe like the view."""
    client.command(f"INSERT INTO {view.target} {view.select}")
