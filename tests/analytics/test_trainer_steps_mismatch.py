"""The trainer's train–inference mismatch lands in ClickHouse and in `rtrl report`: a
trainer_steps table an older sink created gains the columns at start-up, the TrainerStep
records fill them, and the report's line weighs each step by the tokens it measured,
through the /query guard the running stack's report goes through."""

from __future__ import annotations

import pytest

from rtrl import topics
from rtrl.analytics import schema
from rtrl.analytics.query import client_query_fn, connect, project_tables
from rtrl.analytics.sql_guard import checked_sql
from rtrl.analytics.training_report import MismatchSummary, mismatch_summary
from rtrl.config import StackSettings
from rtrl.ops.reporting import mismatch_line
from rtrl.v1 import trainer_pb2
from support import signed

ADDED = [name for name, _ in schema.ADDED_COLUMNS[schema.TRAINER_STEPS]]


def _step(step: int, mean: float, peak: float, share: float, tokens: int):
    return trainer_pb2.TrainerStep(
        step_id=f"warm:{step}",
        lineage="warm",
        step=step,
        published=True,
        ts_ms=1_700_000_000_000 + step,
        mismatch_mean=mean,
        mismatch_max=peak,
        mismatch_over_threshold_share=share,
        mismatch_tokens=tokens,
        mismatch_threshold=0.05,
    )


def _older_trainer_steps_ddl() -> str:
    """The trainer_steps CREATE of a sink from before the mismatch columns."""
    (ddl,) = [d for d in schema.DDL if f"EXISTS {schema.TRAINER_STEPS} " in d]
    kept = [line for line in ddl.splitlines() if line.strip().split(" ")[0] not in ADDED]
    return "\n".join(kept).replace("traceparent String,", "traceparent String")


def test_an_older_table_gains_the_columns_and_the_report_weighs_steps_by_tokens(tmp_path):
    client = connect(StackSettings(state_dir=tmp_path))
    client.command(_older_trainer_steps_ddl())
    assert not set(ADDED) & project_tables(client)[schema.TRAINER_STEPS]
    schema.create_tables(client)
    schema.create_tables(client)  # idempotent
    assert set(ADDED) <= project_tables(client)[schema.TRAINER_STEPS]

    sink = signed.checking_sink(client)
    steps = [
        _step(1, 1e-6, 4e-6, 0.0, 100),
        _step(2, 0.0, 0.0, 0.0, 0),  # started from weights no worker sampled with
        _step(3, 0.1, 0.6, 0.5, 300),
    ]
    for offset, step in enumerate(steps + steps[:1]):  # and one replayed
        sink.add(signed.record(topics.TRAINER_STEPS, 0, offset, b"warm", step.SerializeToString()))
    sink.flush()

    tables = project_tables(client)
    guarded = lambda sql: client_query_fn(client)(checked_sql(sql, tables))
    summary = mismatch_summary(guarded)
    assert summary is not None
    assert (summary.steps, summary.measured_steps, summary.tokens) == (3, 2, 400)
    assert summary.mean == pytest.approx((1e-6 * 100 + 0.1 * 300) / 400)
    assert (summary.max, summary.over_threshold_share, summary.thresholds) == (0.6, 0.375, (0.05,))
    assert mismatch_line(summary) == (
        "train–inference mismatch |Δ log p| (trainer vs sampler, each token under the "
        "version that sampled it): "
        "mean 7.50e-02, max 6.00e-01, 37.50 % over 0.05 nats; 400 tokens in 2 of 3 steps"
    )


def test_a_run_that_never_measured_it_says_so(tmp_path):
    client = connect(StackSettings(state_dir=tmp_path))
    schema.create_tables(client)
    assert mismatch_summary(client_query_fn(client)) is None
    assert "not measured" in mismatch_line(None)


def test_the_line_names_every_threshold_a_run_counted_against():
    summary = MismatchSummary(
        steps=5,
        measured_steps=1,
        tokens=10,
        mean=0.0,
        max=0.0,
        over_threshold_share=0.0,
        thresholds=(0.02, 0.05),
    )
    assert "0.00 % over 0.02/0.05 nats; 10 tokens in 1 of 5 steps" in mismatch_line(summary)
