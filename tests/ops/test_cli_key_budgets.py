"""`rtrl keys create` gives a key one client's budgets unless told otherwise: the defaults
are written into the signed record and said on stderr, each flag overrides its budget, and
0 is unlimited only when asked for."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rtrl.key_budgets import ONE_CLIENT, ONE_CLIENT_BURST_S, Budgets
from support.keys import create_key, record_of, run_keys


def budgets_of(record: dict[str, str]) -> Budgets:
    """The budgets a key's record holds, as the servers read them."""
    return Budgets(
        rate_per_s=float(record["rate_per_s"]),
        burst=float(record["burst"]),
        max_concurrency=int(record["max_concurrency"]),
        max_request_bytes=int(record["max_request_bytes"]),
        max_tokens=int(record["max_tokens"]),
    )


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        # No flags: one editor's budgets.
        ((), ONE_CLIENT),
        # Every flag overrides its own budget.
        (
            (
                "--rate",
                "5",
                "--burst",
                "7",
                "--max-concurrency",
                "2",
                "--max-tokens",
                "64",
                "--max-request-bytes",
                "4096",
            ),
            Budgets(
                rate_per_s=5, burst=7, max_concurrency=2, max_tokens=64, max_request_bytes=4096
            ),
        ),  # fmt: skip
        # 0 lifts a budget, and only that one.
        (("--rate", "0"), replace(ONE_CLIENT, rate_per_s=0, burst=0)),
        (("--max-concurrency", "0"), replace(ONE_CLIENT, max_concurrency=0)),
        # A rate without a burst gets the default seconds of that rate.
        (("--rate", "50"), replace(ONE_CLIENT, rate_per_s=50, burst=50 * ONE_CLIENT_BURST_S)),
    ],
)
def test_keys_create_writes_one_clients_budgets_unless_a_flag_says_otherwise(
    flags, expected, tmp_path, redis_url
):
    created = create_key(redis_url, tmp_path / "no-stack", "editor", *flags)
    assert budgets_of(created.record) == expected
    assert created.said.endswith(f"budgets: {expected.describe()}"), created.said


def test_the_default_budgets_are_stated_and_an_unlimited_one_is_said_as_such(tmp_path, redis_url):
    default = create_key(redis_url, tmp_path, "editor").said
    assert f"{ONE_CLIENT.rate_per_s:g} requests/s" in default
    assert f"completions in flight per server: {ONE_CLIENT.max_concurrency}" in default
    unlimited = create_key(redis_url, tmp_path, "loadtest", "--rate", "0", "--max-concurrency", "0")
    assert "requests/s unlimited" in unlimited.said
    assert "completions in flight per server: unlimited" in unlimited.said
    boxed = run_keys(redis_url, tmp_path, "create", "--help").output
    help_text = " ".join(boxed.replace("│", " ").split())  # rich wraps the help in a box
    assert f"(default: {ONE_CLIENT.rate_per_s:g}; 0: unlimited)" in help_text
    assert f"(default: {ONE_CLIENT.max_concurrency}; 0: unlimited)" in help_text


def test_a_rate_with_a_burst_of_zero_or_a_negative_budget_is_refused_before_any_key_is_made(
    tmp_path, redis_url
):
    for flags in (("--burst", "0"), ("--max-concurrency", "-1")):
        result = run_keys(redis_url, tmp_path, "create", "editor", *flags)
        assert result.exit_code == 2 and result.stdout == "", (flags, result.output)


def test_rotating_a_client_without_keys_issues_one_clients_budgets(tmp_path, redis_url):
    result = run_keys(redis_url, tmp_path, "rotate", "newcomer")
    assert result.exit_code == 0, result.output
    assert budgets_of(record_of(redis_url, result.stdout.strip())) == ONE_CLIENT
