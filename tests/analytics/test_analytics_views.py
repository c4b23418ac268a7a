"""The A/B views (analytics.schema): per arm, policy version and hour they hold the
hand-computed numbers, the same as the base tables read with FINAL, and a replay of
every row (the sink's at-least-once) leaves them unchanged."""

from dataclasses import asdict
from datetime import UTC, datetime, timedelta

import pytest

from rtrl import topics
from rtrl.analytics import report, schema
from rtrl.analytics.query import client_query_fn, connect
from rtrl.config import StackSettings
from rtrl.reward_stream.monitors import is_clarifying_question
from rtrl.v1 import reward_pb2, rollout_pb2
from rtrl_client.v1 import telemetry_pb2
from support import signed
from support.analytics import T0, reward, rollout
from support.reward_stream import QUESTION_CASES

pytestmark = pytest.mark.integration

QUESTION = "Which indent does p2 use?"

# What the sink reads off its topics.
Input = rollout_pb2.RolloutRecord | reward_pb2.RewardRecord | telemetry_pb2.TelemetryEvent

# rollout_id, arm, policy versions of its spans, hour after T0, latency_s, a clarifying
# question (else code), and its reward (persistence_observed, persisted_fraction,
# dissatisfied, reward) or None when it has not settled yet
CASES = [
    ("c1", "control", [1], 0, 0.1, False, (True, 1.0, 0.0, 1.0)),
    ("c2", "control", [1], 0, 0.3, True, (False, 0.0, 0.0, 0.0)),
    ("c3", "control", [1], 1, 0.2, False, (True, 0.5, 1.0, -0.5)),
    ("c4", "control", [1], 1, 0.4, False, (True, 0.9995, 0.0, 0.8)),  # >= 0.999 counts as persisted
    ("c5", "control", [1], 1, 0.9, False, None),  # a rollout, no reward
    ("c6", "control", [2], 0, 0.5, False, (True, 0.998, 0.0, 0.6)),  # just under the threshold
    ("c7", "control", [2], 0, 0.1, False, (True, 1.0, 0.0, 1.0)),
    ("c8", "control", [2], 1, 0.6, True, (False, 0.0, 1.0, -1.0)),
    ("c9", "control", [2], 1, 0.2, False, (True, 1.0, 0.0, 1.0)),
    ("t1", "treatment", [1], 0, 0.2, False, (True, 1.0, 0.0, 1.0)),
    ("t2", "treatment", [1], 0, 0.2, False, (True, 1.0, 1.0, 0.0)),
    ("t3", "treatment", [1], 1, 0.1, True, (False, 0.0, 0.0, 0.0)),
    ("t4", "treatment", [1], 1, 0.3, True, (False, 0.0, 0.0, 0.0)),
    ("t5", "treatment", [2], 0, 0.1, False, (True, 1.0, 0.0, 1.0)),
    (
        "t6",
        "treatment",
        [1, 2],
        0,
        0.3,
        False,
        (True, 1.0, 0.0, 1.0),
    ),  # swapped mid-rollout: version 2
    ("t7", "treatment", [2], 0, 0.8, False, (True, 0.2, 1.0, -0.9)),
    ("t8", "treatment", [2], 1, 0.4, False, (True, 1.0, 0.0, 1.0)),
    (
        "t9",
        "treatment",
        [2],
        1,
        0.2,
        True,
        (False, 1.0, 0.0, 0.0),
    ),  # unobserved never counts as persisted
]

# (arm, version, hour): rollouts, rewards, persisted_rate, dissatisfied_rate,
# clarifying_question_rate, reward_mean, latency_p50_s
HAND_COMPUTED = {
    ("control", 1, 0): (2, 2, 1 / 2, 0.0, 1 / 2, 0.5, 0.2),
    ("control", 1, 1): (3, 2, 1 / 2, 1 / 2, 0.0, 0.15, 0.4),  # c5: a rollout, no reward
    ("control", 2, 0): (2, 2, 1 / 2, 0.0, 0.0, 0.8, 0.3),
    ("control", 2, 1): (2, 2, 1 / 2, 1 / 2, 1 / 2, 0.0, 0.4),
    ("treatment", 1, 0): (2, 2, 1.0, 1 / 2, 0.0, 0.5, 0.2),
    ("treatment", 1, 1): (2, 2, 0.0, 0.0, 1.0, 0.0, 0.2),
    ("treatment", 2, 0): (3, 3, 2 / 3, 1 / 3, 0.0, 1.1 / 3, 0.3),
    ("treatment", 2, 1): (2, 2, 1 / 2, 0.0, 1 / 2, 0.5, 0.3),
}
HAND_METRICS = (
    "rollouts",
    "rewards",
    "persisted_rate",
    "dissatisfied_rate",
    "clarifying_question_rate",
    "reward_mean",
    "latency_p50_s",
)

# Hours are counted from T0, which falls on the hour.
BASE_REWARDS = (
    "SELECT arm, policy_version AS version, "
    f"intDiv(toUnixTimestamp(rollout_ts) - {T0 // 1000}, 3600) AS hour,\n"
    "    count() AS rewards,\n"
    f"    avg(persistence_observed AND persisted_fraction >= {schema.PERSISTED_THRESHOLD})"
    " AS persisted_rate,\n"
    "    avg(dissatisfied > 0) AS dissatisfied_rate, avg(followup_observed) AS followup_rate,"
    " avg(defaulted) AS defaulted_rate,\n"
    "    avg(reward) AS reward_mean, avg(persisted_fraction) AS persisted_fraction,"
    " avg(dissatisfied) AS dissatisfied,\n"
    "    avg(tool_call_validity) AS tool_call_validity, avg(effort_penalty) AS effort_penalty\n"
    f"FROM rewards FINAL WHERE topic = '{topics.REWARD}' GROUP BY arm, version, hour\n"
    "SETTINGS prefer_column_name_to_alias = 1"
)
BASE_ROLLOUTS = f"""SELECT arm, policy_version_max AS version, intDiv(toUnixTimestamp(ts) - {T0 // 1000}, 3600) AS hour,
    count() AS rollouts, avg({schema.CLARIFYING_QUESTION}) AS clarifying_question_rate,
    quantileExactInclusive(0.5)(latency_s) AS latency_p50_s, quantileExactInclusive(0.9)(latency_s) AS latency_p90_s,
    quantileExactInclusive(0.99)(latency_s) AS latency_p99_s
FROM rollouts FINAL GROUP BY arm, version, hour"""


def records() -> list[tuple[str, Input]]:
    """(topic, message) of every case, and a late input (on .late) the views must leave out."""
    out: list[tuple[str, Input]] = []
    for rollout_id, arm, versions, hour, latency_s, question, settled in CASES:
        r = rollout(rollout_id, arm, versions, latency_s, hour * 3600 + 60 * int(rollout_id[1:]))
        if question:
            r.completion_text = QUESTION
        out.append((topics.ROLLOUT, r))
        if settled is not None:
            out.append((topics.REWARD, reward(r, *settled)))
    late = telemetry_pb2.TelemetryEvent(
        event_id="late-c1",
        rollout_id="c1",
        followup=telemetry_pb2.FollowUp(message="this is wrong"),
    )
    out.append((topics.REWARD_LATE, late))
    return out


class Feeder:
    """Writes records through the real sink (rows conversion, batched inserts)."""

    def __init__(self, client):
        # The recording double stands in for the sink's confluent_kafka Consumer.
        self.sink = signed.checking_sink(client, batch_size=10_000)
        self.offset = 0

    def insert(self, batch: list[tuple[str, Input]]) -> None:
        for topic, message in batch:
            # The joiner's headers on a late input: where it came from.
            headers = (
                (("source_topic", topics.FOLLOWUP.encode()), ("kind", b"followup"))
                if topic == topics.REWARD_LATE
                else ()
            )
            self.sink.add(
                signed.record(
                    topic,
                    0,
                    self.offset,
                    message.rollout_id.encode(),
                    message.SerializeToString(),
                    headers,
                )
            )
            self.offset += 1
        self.sink.flush()


@pytest.fixture
def client(tmp_path):
    client = connect(StackSettings(state_dir=tmp_path))
    yield client
    client.close()


def from_views(client) -> dict[tuple, dict]:
    """(arm, version, hour after T0) -> every metric of report.by_hour."""
    t0 = datetime.fromtimestamp(T0 / 1000, UTC)
    out = {}
    for row in report.by_hour(client_query_fn(client)):
        metrics = asdict(row)
        key = (
            metrics.pop("arm"),
            metrics.pop("policy_version"),
            (metrics.pop("hour") - t0) // timedelta(hours=1),
        )
        out[key] = metrics
    return out


def from_base_tables(client) -> dict[tuple, dict]:
    """The same metrics aggregated directly over the deduplicated base tables."""
    query = client_query_fn(client)
    rewards = {(r.pop("arm"), r.pop("version"), r.pop("hour")): r for r in query(BASE_REWARDS)}
    rollouts = {(r.pop("arm"), r.pop("version"), r.pop("hour")): r for r in query(BASE_ROLLOUTS)}
    assert rewards.keys() == rollouts.keys()
    return {key: {**rewards[key], **rollouts[key]} for key in rewards}


def assert_hand_computed_and_base(views: dict[tuple, dict], client) -> None:
    assert views.keys() == HAND_COMPUTED.keys()
    for key, row in views.items():
        assert tuple(row[m] for m in HAND_METRICS) == pytest.approx(HAND_COMPUTED[key]), key
    base = from_base_tables(client)
    assert views.keys() == base.keys()
    for key, row in views.items():
        assert row == pytest.approx(base[key]), key


def test_views_hold_the_hand_computed_numbers_and_a_replay_changes_none(client):
    schema.create_tables(client)
    feeder = Feeder(client)
    batch = records()
    feeder.insert(batch)
    views = from_views(client)
    assert_hand_computed_and_base(views, client)

    # The sink's replay: every row again, in a later insert and twice within one insert.
    feeder.insert(batch + batch)
    assert dict(feeder.sink.inserted) == {
        schema.ROLLOUTS: 3 * 18,
        schema.REWARDS: 3 * 17,
        schema.LATE: 3,
    }
    assert from_views(client) == views
    for table in (schema.ROLLOUTS, schema.REWARDS, schema.AB_ROLLOUTS, schema.AB_REWARDS):
        client.command(f"OPTIMIZE TABLE {table} FINAL")
    assert from_views(client) == views
    assert_hand_computed_and_base(views, client)


def create_views_without_backfill(client) -> None:
    for view in schema.VIEWS:
        client.command(view.target_ddl)
        client.command(view.ddl)


# How the data came before the views: created later (a new view on an old table), or
# created just before a crash that skipped the backfill (the target stays empty).
BACKFILL_CASES = {
    "views_created_after_the_data": lambda client: None,
    "crash_between_view_and_backfill": create_views_without_backfill,
}


@pytest.mark.parametrize("before_start", BACKFILL_CASES.values(), ids=BACKFILL_CASES.keys())
def test_rows_inserted_before_the_views_are_backfilled_once(client, before_start):
    for statement in schema.DDL:
        client.command(statement)
    feeder = Feeder(client)
    batch = records()
    feeder.insert(batch + batch)
    before_start(client)

    schema.create_tables(client)
    views = from_views(client)
    assert_hand_computed_and_base(views, client)

    # The view now sees the replays too, and a second backfill overlaps both: no change.
    feeder.insert(batch)
    for view in schema.VIEWS:
        schema.backfill(client, view)
    assert from_views(client) == views


def test_the_ddl_is_idempotent(client):
    schema.create_tables(client)
    schema.create_tables(client)
    tables = {
        row["name"]
        for row in client_query_fn(client)(
            "SELECT name FROM system.tables WHERE database = currentDatabase()"
        )
    }
    assert tables == {
        schema.ROLLOUTS,
        schema.TELEMETRY,
        schema.REWARDS,
        schema.DEAD_LETTERS,
        schema.LATE,
        schema.TRAINER_STEPS,
        schema.TRAJECTORY_LINKS,
    } | {name for view in schema.VIEWS for name in (view.name, view.target)}

    Feeder(client).insert(records())
    views = from_views(client)
    schema.create_tables(client)
    assert from_views(client) == views


def test_by_version_reads_the_views_merged_over_hours(client):
    schema.create_tables(client)
    Feeder(client).insert(records())
    rows = report.by_version(client_query_fn(client), bucket_size=1)
    # rewards, persisted_rate, dissatisfied_rate, reward_mean, latency_p50_s; control v1 holds
    # c1-c4 (c5 has no reward) but its latency is the median of c1-c5; t6 is in v2.
    expected = {
        ("control", 1): (4, 1 / 2, 1 / 4, 0.325, 0.3),
        ("control", 2): (4, 1 / 2, 1 / 4, 0.4, 0.35),
        ("treatment", 1): (4, 1 / 2, 1 / 4, 0.25, 0.2),
        ("treatment", 2): (5, 3 / 5, 1 / 5, 0.42, 0.3),
    }
    assert [(v.arm, v.policy_version, v.bucket_size) for v in rows] == [
        (*key, 1) for key in expected
    ]
    for v in rows:
        assert (
            v.rewards,
            v.persisted_rate,
            v.dissatisfied_rate,
            v.reward_mean,
            v.latency_p50_s,
        ) == pytest.approx(expected[v.arm, v.policy_version])


def test_the_clarifying_question_rule_is_the_monitors(client):
    cases = {
        **QUESTION_CASES,
        "tab_indented_code": ("Use\n\treturn x\nok?", False),
        "crlf_after_the_mark": ("Tabs?\r\n", True),
    }
    result = client.query(
        f"SELECT completion_text, {schema.CLARIFYING_QUESTION} AS question"
        " FROM (SELECT arrayJoin({texts:Array(String)}) AS completion_text)",
        parameters={"texts": [text for text, _ in cases.values()]},
    )
    question = {text: bool(flag) for text, flag in result.result_rows}
    in_sql = {name: question[text] for name, (text, _) in cases.items()}
    assert in_sql == {name: is_clarifying_question(text) for name, (text, _) in cases.items()}
    assert in_sql == {name: expected for name, (_, expected) in cases.items()}
