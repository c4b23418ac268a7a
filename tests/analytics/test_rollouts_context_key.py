"""The context_key a product sends with a request lands in ClickHouse: a rollouts table an
older sink created gains the column at start-up, and the RolloutRecords fill it."""

from __future__ import annotations

from rtrl import topics
from rtrl.analytics import schema
from rtrl.analytics.query import client_query_fn, connect, project_tables
from rtrl.config import StackSettings
from rtrl.v1 import rollout_pb2
from support import signed

ADDED = [name for name, _ in schema.ADDED_COLUMNS[schema.ROLLOUTS]]


def _older_rollouts_ddl() -> str:
    """The rollouts CREATE of a sink from before the context_key column."""
    (ddl,) = [d for d in schema.DDL if f"EXISTS {schema.ROLLOUTS} " in d]
    kept = [line for line in ddl.splitlines() if line.strip().split(" ")[0] not in ADDED]
    return "\n".join(kept).replace("traceparent String,", "traceparent String")


def test_an_older_rollouts_table_gains_context_key_and_records_fill_it(tmp_path):
    client = connect(StackSettings(state_dir=tmp_path))
    client.command(_older_rollouts_ddl())
    assert "context_key" not in project_tables(client)[schema.ROLLOUTS]
    schema.create_tables(client)
    schema.create_tables(client)  # idempotent
    assert "context_key" in project_tables(client)[schema.ROLLOUTS]

    sink = signed.checking_sink(client)
    rollouts = [
        rollout_pb2.RolloutRecord(
            rollout_id="r1", event_id="e1", client_ts_ms=1_700_000_000_000, context_key="repo:a/b"
        ),
        # None sent: an empty string, like every other absent string column.
        rollout_pb2.RolloutRecord(rollout_id="r2", event_id="e2", client_ts_ms=1_700_000_000_001),
    ]
    for offset, rollout in enumerate(rollouts):
        value = rollout.SerializeToString()
        sink.add(signed.record(topics.ROLLOUT, 0, offset, rollout.rollout_id.encode(), value))
    sink.flush()

    rows = client_query_fn(client)(
        f"SELECT rollout_id, context_key FROM {schema.ROLLOUTS} FINAL ORDER BY rollout_id"
    )
    assert rows == [
        {"rollout_id": "r1", "context_key": "repo:a/b"},
        {"rollout_id": "r2", "context_key": ""},
    ]
