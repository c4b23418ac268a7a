"""What the operator's CLI prints: `--json` documents a script can parse (keys list, report,
bench), tables that stay whole when stdout is not a terminal, `--scopes` with its old name
`--events`, and `keys list` without a client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rtrl import topics
from rtrl.analytics import schema
from rtrl.analytics.query import connect
from rtrl.config import StackSettings
from rtrl.ops.cli_common import EXIT_CODES
from support import signed
from support.analytics import RecordingConsumer, hand_made_records
from support.keys import create_key, record_of, run_keys

REPO = Path(__file__).resolve().parents[2]


def rtrl(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    """The installed `rtrl`, its stdout a pipe (not a terminal), COLUMNS unset."""
    environ = {k: v for k, v in os.environ.items() if k != "COLUMNS"} | env
    return subprocess.run(
        [sys.executable, "-m", "rtrl", *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def test_scopes_and_their_old_name_events_set_the_same_scopes(tmp_path, redis_url):
    new = create_key(redis_url, tmp_path, "chat", "--scopes", "followup,completions")
    old = create_key(redis_url, tmp_path, "chat", "--events", "followup,completions")
    assert new.record["scopes"] == old.record["scopes"] == "completions,followup"
    refused = run_keys(redis_url, tmp_path, "create", "chat", "--scopes", "everything")
    assert refused.exit_code == 2 and "unknown scopes" in refused.stderr


def test_keys_list_without_a_client_lists_every_key_and_prints_json(tmp_path, redis_url):
    a = create_key(redis_url, tmp_path, "editor", "--rate", "5")
    b = create_key(redis_url, tmp_path, "chat-widget", "--scopes", "followup")
    assert run_keys(redis_url, tmp_path, "revoke", b.key).exit_code == 0

    listed = run_keys(redis_url, tmp_path, "list", "--json")
    assert listed.exit_code == 0, listed.output
    rows = {row["key_hash"]: row for row in json.loads(listed.stdout)}
    assert rows.keys() == {a.digest, b.digest}
    assert rows[a.digest]["client_id"] == "editor" and rows[a.digest]["rate_per_s"] == 5.0
    assert rows[a.digest]["revoked"] is False and rows[b.digest]["revoked"] is True
    assert rows[b.digest]["scopes"] == ["followup"]
    assert rows[a.digest]["created_ms"] == int(record_of(redis_url, a.key)["created_ms"])

    one = json.loads(run_keys(redis_url, tmp_path, "list", "chat-widget", "--json").stdout)
    assert [row["key_hash"] for row in one] == [b.digest]
    assert json.loads(run_keys(redis_url, tmp_path, "list", "nobody", "--json").stdout) == []


def test_a_table_is_whole_when_stdout_is_not_a_terminal(tmp_path, redis_url):
    created = create_key(redis_url, tmp_path, "an-editor-with-a-rather-long-client-id")
    shown = rtrl("keys", "list", env={"RTRL_REDIS_URL": redis_url, "RTRL_STATE_DIR": str(tmp_path)})
    assert shown.returncode == 0, shown.stderr
    # Every header and cell in full: rich's default 80 columns would cut them to "…".
    assert created.digest in shown.stdout and "…" not in shown.stdout
    assert "an-editor-with-a-rather-long-client-id" in shown.stdout
    for header in ("max request bytes", "expires (ms)", "created (ms)"):
        assert header in shown.stdout


@pytest.fixture
def analytics_state_dir(tmp_path) -> Path:
    """A state directory whose analytics hold the hand-made run of tests/analytics (no stack)."""
    state_dir = tmp_path / "state"
    client = connect(StackSettings(state_dir=state_dir))
    try:
        schema.create_tables(client)
        sink = signed.checking_sink(client, RecordingConsumer())
        rollouts, rewards = hand_made_records()
        for topic, records in ((topics.ROLLOUT, rollouts), (topics.REWARD, rewards)):
            for offset, message in enumerate(records):
                sink.add(
                    signed.record(
                        topic, 0, offset, message.rollout_id.encode(), message.SerializeToString()
                    )
                )
        sink.flush()
    finally:
        client.close()
    return state_dir


@pytest.mark.integration
def test_report_json_is_the_ab_tables_and_the_files_written(analytics_state_dir, tmp_path):
    html = tmp_path / "out" / "report.html"
    done = rtrl(
        "report", "--json", "--html", str(html), env={"RTRL_STATE_DIR": str(analytics_state_dir)}
    )
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)  # stdout is the document and nothing else
    assert document["ab"] == json.loads((tmp_path / "out" / "ab.json").read_text())
    assert set(document["ab"]["whole_run"]) == {"control", "treatment"}
    assert document["ab"]["whole_run"]["control"]["rollouts"] > 0
    assert document["html"] == str(html.resolve()) and html.exists()
    assert "reading the analytics kept in" in done.stderr

    empty = rtrl(
        "report", "--json", "--html", str(html), env={"RTRL_STATE_DIR": str(tmp_path / "none")}
    )
    assert empty.returncode == 1 and json.loads(empty.stdout)["ab"] == {}


@pytest.mark.slow
def test_bench_json_is_the_results_file(tmp_path):
    out = tmp_path / "trainer.json"
    args = ("bench", "trainer", "--batch", "4", "--steps", "1", "--out", str(out), "--json")
    done = rtrl(*args, env={"RTRL_STATE_DIR": str(tmp_path / "state")})
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document == json.loads(out.read_text())
    assert document["batch"] == 4 and document["tokens_per_s"] > 0


def test_the_cli_reference_documents_every_exit_code():
    reference = (REPO / "docs" / "cli.md").read_text()
    for code, meaning in EXIT_CODES.items():
        assert f"| {code} | {meaning.split(':')[0]}" in reference
