"""`rtrl keys`: API keys of product clients, kept hashed and signed in the stack's Redis."""

from __future__ import annotations

import os

import typer

from rtrl.key_budgets import ONE_CLIENT, ONE_CLIENT_BURST_S
from rtrl.ops.cli_common import (
    FAILED,
    JSON_OPTION,
    USAGE,
    console,
    err_console,
    print_json,
    state_dir,
)

keys_app = typer.Typer(
    help="API keys of product clients, stored hashed in the Redis of the stack running in "
    "RTRL_STATE_DIR (or RTRL_REDIS_URL's).",
    no_args_is_help=True,
)

LISTED = (
    ("client_id", "client"),
    ("key_hash", "key sha256"),
    ("scopes", "scopes"),
    ("rate_per_s", "rate/s"),
    ("burst", "burst"),
    ("max_concurrency", "in flight"),
    ("max_tokens", "max tokens"),
    ("max_request_bytes", "max request bytes"),
    ("revoked", "revoked"),
    ("expires_ms", "expires (ms)"),
    ("created_ms", "created (ms)"),
)
"""A key record's fields as `rtrl keys list` shows them (rtrl/api_keys.py writes them)."""
NUMBERS = {"rate_per_s": float, "burst": float, "max_concurrency": int, "max_tokens": int,
           "max_request_bytes": int, "expires_ms": int, "created_ms": int}  # fmt: skip
"""Fields --json prints as numbers (Redis keeps text); ``revoked`` is a boolean."""


def _typed(row: dict[str, str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for field, _ in LISTED:
        value = row.get(field)
        if value is not None and field in NUMBERS:
            out[field] = NUMBERS[field](value)
        elif field == "revoked":
            out[field] = value == "1"
        elif field == "scopes":
            out[field] = sorted(value.split(",")) if value else []
        else:
            out[field] = value
    return out


def _redis_url() -> str:
    """The Redis of the stack running in RTRL_STATE_DIR, as its ``operator`` user, or
    RTRL_REDIS_URL when set (a production Redis); never a default address, where any
    Redis may listen."""
    from rtrl.ops.health import running_stack

    here = state_dir()
    stack = running_stack(here)
    if stack is not None:
        if os.environ.get("RTRL_REDIS_URL", stack.redis_url) != stack.redis_url:
            err_console.print(
                f"[yellow]RTRL_REDIS_URL is set, but the stack in {here} "
                "runs its own Redis: using the stack's[/]"
            )
        err_console.print(f"using the stack in {here} (redis {stack.redis_url})")
        return stack.redis_url_as("operator")
    if "RTRL_REDIS_URL" in os.environ:
        err_console.print(
            f"no stack running in {here}: using RTRL_REDIS_URL ({os.environ['RTRL_REDIS_URL']})"
        )
        return os.environ["RTRL_REDIS_URL"]
    err_console.print(
        f"[red]no stack running in {here}[/]: start one with `rtrl up`, or set RTRL_REDIS_URL to your Redis"
    )
    raise typer.Exit(FAILED)


def _redis_call(function, *args, **kwargs):
    from rtrl.api_keys import call_sync

    return call_sync(_redis_url(), function, *args, **kwargs)


def _authority():
    """The operator's signer of key records: the stack's own, or RTRL_API_KEY_SIGNING_KEY."""
    from rtrl.ops.stack_secrets import key_authority

    try:
        return key_authority(state_dir())
    except (RuntimeError, PermissionError) as exc:
        err_console.print(f"[red]{exc}[/]")
        raise typer.Exit(FAILED) from None


@keys_app.command("create")
def keys_create(
    client: str = typer.Argument(..., help="Client id the key belongs to."),
    scopes: str = typer.Option(
        "*",
        "--scopes",
        "--events",
        help="Comma-separated scopes: event types it may send "
        "(edit_shown, edit_outcome, persistence, followup, or * for all), "
        "and `completions` for the serving API (never implied by *). "
        "--events is the old name, kept as an alias.",
    ),
    rate: float | None = typer.Option(
        None,
        help="Events (gateway) plus completions (serving API) per second, from one bucket "
        f"(default: {ONE_CLIENT.rate_per_s:g}; 0: unlimited).",
    ),
    burst: float | None = typer.Option(
        None,
        help=f"Largest burst (default: {ONE_CLIENT_BURST_S:g} seconds' worth of the rate, "
        f"{ONE_CLIENT.burst:g} at the default rate).",
    ),
    max_request_bytes: int | None = typer.Option(
        None, help="Serving API: largest request body in bytes (default: 0, the server's bound)."
    ),
    max_tokens: int | None = typer.Option(
        None,
        help="Serving API: most tokens one completion may ask for (default: 0, the server's bound).",
    ),
    max_concurrency: int | None = typer.Option(
        None,
        help="Serving API: completions in flight at once, per server "
        f"(default: {ONE_CLIENT.max_concurrency}; 0: unlimited).",
    ),
) -> None:
    """Issue a key; it is printed once and stored only as its hash, signed by the operator.

    Budgets not given are one editor's (rtrl/key_budgets.py ONE_CLIENT): a few completions in
    flight, a few a second with bursts, and their telemetry. Give a product's shared key, or
    a load test's, budgets of its own; 0 lifts a budget. The budgets are printed on stderr."""
    from rtrl.api_keys import issue_key
    from rtrl.key_budgets import client_budgets

    try:
        budgets = client_budgets(rate, burst, max_concurrency, max_request_bytes, max_tokens)
        key = _redis_call(
            issue_key, _authority(), client, scopes=set(scopes.split(",")), **budgets.issue_args()
        )
    except ValueError as exc:
        err_console.print(f"[red]{exc}[/]")
        raise typer.Exit(USAGE) from None
    console.print(key)
    err_console.print(f"budgets: {budgets.describe()}")


@keys_app.command("rotate")
def keys_rotate(
    client: str = typer.Argument(..., help="Client id whose keys are rotated."),
    grace_s: float = typer.Option(3600.0, help="How long the client's current keys keep working."),
) -> None:
    """Issue a new key for a client; its current keys expire after the grace period."""
    from rtrl.api_keys import rotate_keys

    console.print(_redis_call(rotate_keys, _authority(), client, grace_s))


@keys_app.command("revoke")
def keys_revoke(
    key: str = typer.Argument(..., help="The key, or its SHA-256 as `rtrl keys list` shows it."),
) -> None:
    """Revoke one key at once (gateways notice within RTRL_INGEST_KEY_CACHE_TTL_S)."""
    from rtrl.api_keys import revoke_key

    if not _redis_call(revoke_key, _authority(), key):
        err_console.print("[red]no such key[/]")
        raise typer.Exit(FAILED)


@keys_app.command("list")
def keys_list(
    client: str | None = typer.Argument(None, help="Only this client's keys (default: all)."),
    as_json: bool = JSON_OPTION,
) -> None:
    """Keys (their SHA-256), scopes, budgets and state: every client's, or one client's."""
    from rich.table import Table

    from rtrl.api_keys import list_keys

    rows = _redis_call(list_keys, client)
    if as_json:
        print_json([_typed(row) for row in rows])
        return
    table = Table(*(title for _, title in LISTED))
    for row in rows:
        table.add_row(*(row.get(field, "") for field, _ in LISTED))
    console.print(table)
    if not rows:
        err_console.print(f"no keys{f' for {client}' if client else ''}")
