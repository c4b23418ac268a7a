"""The `rtrl` command line: run the embedded stack, watch it, drive it, report on it.

Heavy imports (torch, faust, chdb) happen inside commands, so `--help` is instant.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from rich.console import Console

from rtrl.key_budgets import ONE_CLIENT, ONE_CLIENT_BURST_S
from rtrl.runtime import owner_only_files

app = typer.Typer(
    help="rtrl: real-time reinforcement learning from product telemetry.", no_args_is_help=True
)
bench_app = typer.Typer(
    help="Benchmarks; each writes bench/results/<name>.json.", no_args_is_help=True
)
app.add_typer(bench_app, name="bench")
keys_app = typer.Typer(
    help="API keys of product clients, stored hashed in the Redis of the stack running in "
    "RTRL_STATE_DIR (or RTRL_REDIS_URL's).",
    no_args_is_help=True,
)
app.add_typer(keys_app, name="keys")
model_app = typer.Typer(help="Model directories: a tiny random one to try `rtrl up --model` on.")
app.add_typer(model_app, name="model")


@model_app.command("tiny")
def model_tiny(
    out_dir: Path,
    family: str = typer.Option(
        "qwen3", help="llama, mistral, qwen2, qwen3, qwen3_moe, mixtral, gpt2"
    ),
    seed: int = typer.Option(0),
) -> None:
    """Write a tiny random Hugging Face checkpoint with a byte-level BPE tokenizer and a
    ChatML chat template to OUT_DIR (it says nothing useful; every path is real)."""
    from rtrl.ops.tiny_model import FAMILIES, write_tiny_checkpoint

    if family not in FAMILIES:
        console.print(f"[red]unknown family {family!r}[/]: one of {', '.join(FAMILIES)}")
        raise typer.Exit(2)
    console.print(f"wrote {write_tiny_checkpoint(out_dir, family, seed=seed)}")


console = Console()
err_console = Console(stderr=True, soft_wrap=True)


def _state_dir() -> Path:
    from rtrl.config import StackSettings

    return StackSettings().state_dir.resolve()


def _require_stack():
    from rtrl.ops.health import running_stack

    stack = running_stack(_state_dir())
    if stack is None:
        console.print("[red]no stack running[/]: start one with `rtrl up`")
        raise typer.Exit(1)
    return stack


FRESH = typer.Option(
    False,
    "--fresh",
    help="Start over from the warm start: empty the state directory but for its cache.",
)


@app.command()
def up(
    fresh: bool = FRESH,
    model: Path | None = typer.Option(
        None,
        "--model",
        help="A Hugging Face model directory (config.json, safetensors, tokenizer.json, chat "
        "template) to serve and train instead of the demo policy (RTRL_MODEL_DIR).",
    ),
) -> None:
    """Start the embedded stack (Tansu, Redis, chdb, every service) and wait until healthy.
    Resumes the run in RTRL_STATE_DIR (lineage, registry, blobs, checkpoint, API keys,
    analytics); only the memory-only broker's topics start empty."""
    from rtrl.ops.lifecycle import StackError
    from rtrl.ops.lifecycle import up as start

    try:
        stack = start(_state_dir(), console, fresh=fresh, model_dir=model)
    except StackError as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(1) from None
    _print_endpoints(stack)


def _print_endpoints(stack) -> None:
    from rich.table import Table

    table = Table(title="endpoints", title_justify="left")
    table.add_column("what")
    table.add_column("where")
    table.add_row("kafka (tansu)", stack.kafka_bootstrap)
    table.add_row("redis", stack.redis_url)
    table.add_row("clickhouse", stack.clickhouse_url)
    table.add_row("weight sync (gRPC)", stack.weight_sync_addr)
    for spec in stack.services:
        for var, port in spec.ports.items():
            table.add_row(f"{spec.key} {var.removeprefix('RTRL_').lower()}", f"127.0.0.1:{port}")
    table.add_row("logs", str(Path(stack.state_dir) / "logs"))
    console.print(table)


@app.command()
def down() -> None:
    """Stop the embedded stack and every process it started."""
    from rtrl.ops.lifecycle import down as stop

    stop(_state_dir(), console)


@app.command()
def status(
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh every second until Ctrl-C."),
    as_json: bool = typer.Option(
        False,
        "--json",
        help="Print the status as one JSON object (rtrl.ops.status_view.StackStatus) for scripts.",
    ),
) -> None:
    """Health of every component, consumer lag per topic, policy version per worker."""
    from rich.live import Live

    from rtrl.ops import status_view
    from rtrl.ops.status_view import render

    stack = _require_stack()
    if as_json:
        print(json.dumps(status_view.as_json(status_view.collect(stack)), indent=1))
        return
    err_console.print(f"the stack in {stack.state_dir} (supervisor pid {stack.supervisor_pid})")
    if not watch:
        console.print(render(stack))
        return
    with Live(render(stack), console=console, refresh_per_second=1) as live:
        try:
            while True:
                time.sleep(1)
                live.update(render(stack))
        except KeyboardInterrupt:
            pass


@app.command()
def demo(
    minutes: float = typer.Option(5.0, help="How long the simulated product runs."),
    keep_running: bool = typer.Option(False, help="Leave the stack up afterwards."),
    product: str = typer.Option(
        "agent",
        help="agent: an agent harness calling tools over several turns (reward a1); edits: "
        "the single-turn product (reward r3).",
    ),
    reward_fn: str | None = typer.Option(
        None,
        help="Reward function to settle with (sets RTRL_STACK_REWARD_FN_VERSION). r1 pays for "
        "asking instead of editing; a1h lets a broken tool call discard a rollout.",
    ),
    unique_prompts: bool = typer.Option(
        False,
        help="edits: no prompt is ever asked twice (a serial in every task), as in real "
        "traffic (the agent's prompts always are); the trainer uses the context baseline "
        "(RTRL_TRAINER_BASELINE=context). Implies --fresh.",
    ),
    fresh: bool = FRESH,
) -> None:
    """Start the stack, run the simulated product with live progress, print the A/B table
    and the reward-hacking alerts."""
    from rtrl.ops.demo import run_demo

    if product not in ("agent", "edits"):
        raise typer.BadParameter("agent or edits", param_hint="--product")
    code = run_demo(
        _state_dir(),
        console,
        product=product,
        minutes=minutes,
        keep_running=keep_running,
        reward_fn=reward_fn,
        unique_prompts=unique_prompts,
        fresh=fresh,
    )
    if code:
        raise typer.Exit(code)


@app.command()
def report(
    html: Path = typer.Option(Path("reports/report.html"), help="Where to write the HTML report."),
) -> None:
    """The A/B table (edits persisted, dissatisfied follow-ups, latency) per arm, and an HTML report."""
    from rtrl.ops.health import running_stack
    from rtrl.ops.reporting import print_report

    stack = running_stack(_state_dir())
    if stack is not None:
        err_console.print(f"reading the stack in {stack.state_dir} ({stack.clickhouse_url})")
    else:
        err_console.print(f"no stack running: reading the analytics kept in {_state_dir()}")
    print_report(stack, console, html=html, state_dir=_state_dir())


@bench_app.command("loop")
def bench_loop(
    minutes: float = typer.Option(2.0, help="How long the product drives the loop."),
    product: str = typer.Option("edits", help="edits (single-turn) or agent (trajectories)."),
    out: Path | None = typer.Option(None, help="Default: bench/results/loop[-agent].json."),
) -> None:
    """Event-to-live latency: last event of a version's newest rollout until every worker serves it."""
    from rtrl.bench.loop import run

    if product not in ("agent", "edits"):
        raise typer.BadParameter("agent or edits", param_hint="--product")
    default = Path(
        "bench/results/loop.json" if product == "edits" else "bench/results/loop-agent.json"
    )
    run(_state_dir(), minutes * 60, out or default, console, product)


@bench_app.command("codec")
def bench_codec(out: Path = typer.Option(Path("bench/results/codec.json"))) -> None:
    """Delta size and speed on real deltas (MiniLM fine-tune in bf16, a demo policy step)."""
    from rtrl.bench.codec import run

    run(out, console)


@bench_app.command("broadcast")
def bench_broadcast(
    rounds: int = typer.Option(15, help="Deltas timed per topology."),
    out: Path = typer.Option(Path("bench/results/broadcast.json")),
) -> None:
    """Time for one new version to reach 1, 2, 4 and 8 subscriber processes, direct and through relays."""
    from rtrl.bench.broadcast import run

    run(out, console, rounds=rounds)


@bench_app.command("join")
def bench_join(
    rollouts: int = typer.Option(20_000, help="Rollouts of three records each in the load."),
    spacing_ms: int = typer.Option(2, help="Event time between consecutive rollouts."),
    live_rollouts: int = typer.Option(
        2_000, help="Rollouts produced in real time for the settle latency."
    ),
    live_rate: float = typer.Option(250.0, help="Live rollouts per second."),
    rounds: int = typer.Option(
        3,
        min=1,
        help="Rounds of the faust floor and one worker, alternating; the best of each counts.",
    ),
    trajectory_rollouts: int = typer.Option(500, help="Rollouts of each agent load (4k, 32k)."),
    out: Path = typer.Option(Path("bench/results/join.json")),
) -> None:
    """Reward-join events/s against a faust floor, 2 workers vs 1, settle latency; 4k/32k agents."""
    from rtrl.bench.join import run

    run(
        out,
        console,
        rollouts=rollouts,
        spacing_ms=spacing_ms,
        live_rollouts=live_rollouts,
        live_rate_per_s=live_rate,
        rounds=rounds,
        trajectory_rollouts=trajectory_rollouts,
    )


@bench_app.command("engine")
def bench_engine(
    concurrency: int = typer.Option(
        8, help="Requests in flight at once (and HF generate()'s batch)."
    ),
    max_tokens: int = typer.Option(48, help="Tokens per completion, on both sides."),
    phase_s: float = typer.Option(10.0, help="Seconds per measured phase."),
    turns: int = typer.Option(20, help="Turns per agent in the multi-turn workload (0: skip it)."),
    out: Path = typer.Option(Path("bench/results/engine.json")),
) -> None:
    """Engine tokens/s against HF generate() on the same model and prompts, the slowdown while
    versions arrive, and an agent's turns with its keys and values kept against re-sent."""
    from rtrl.bench.engine import run

    multi_turn = (3, turns, 50, 200) if turns else None
    run(
        out, console, concurrency=concurrency, max_tokens=max_tokens, phase_s=phase_s,
        turns=multi_turn,
    )  # fmt: skip


@bench_app.command("trainer")
def bench_trainer(
    batch: int = typer.Option(64, help="Rollouts per training step."),
    steps: int = typer.Option(10, help="Steps per side per round (3 rounds, alternating)."),
    out: Path = typer.Option(Path("bench/results/trainer.json")),
) -> None:
    """Training-step tokens/s against a bare torch loop doing the same forward/backward on the same batch."""
    from rtrl.bench.trainer import run

    run(out, console, batch_size=batch, steps=steps)


@bench_app.command("trainer-memory")
def bench_trainer_memory(
    out: Path = typer.Option(Path("bench/results/trainer_memory.json")),
) -> None:
    """The trainer's peak memory on 4k and 32k-token trajectories, and what micro-batches save."""
    from rtrl.bench.trainer_memory import run

    run(out, console)


@bench_app.command("ingest")
def bench_ingest(
    events: int = typer.Option(60_000, help="Events per round and side."),
    batch: int = typer.Option(500, help="Events per gateway request."),
    concurrency: int = typer.Option(8, help="Gateway requests in flight."),
    rounds: int = typer.Option(3, help="Alternating rounds; the best of each side is reported."),
    out: Path = typer.Option(Path("bench/results/ingest.json")),
) -> None:
    """Events/s through the gateway against a bare confluent-kafka producer on the same broker."""
    from rtrl.bench.ingest import run

    run(out, console, events_per_round=events, batch=batch, concurrency=concurrency, rounds=rounds)


def _redis_url() -> str:
    """The Redis of the stack running in RTRL_STATE_DIR, as its ``operator`` user, or
    RTRL_REDIS_URL when set (a production Redis); never a default address, where any
    Redis may listen."""
    import os

    from rtrl.ops.health import running_stack

    stack = running_stack(_state_dir())
    if stack is not None:
        if os.environ.get("RTRL_REDIS_URL", stack.redis_url) != stack.redis_url:
            err_console.print(
                f"[yellow]RTRL_REDIS_URL is set, but the stack in {_state_dir()} "
                "runs its own Redis: using the stack's[/]"
            )
        err_console.print(f"using the stack in {_state_dir()} (redis {stack.redis_url})")
        return stack.redis_url_as("operator")
    if "RTRL_REDIS_URL" in os.environ:
        err_console.print(
            f"no stack running in {_state_dir()}: using RTRL_REDIS_URL ({os.environ['RTRL_REDIS_URL']})"
        )
        return os.environ["RTRL_REDIS_URL"]
    err_console.print(
        f"[red]no stack running in {_state_dir()}[/]: start one with `rtrl up`, or set RTRL_REDIS_URL to your Redis"
    )
    raise typer.Exit(1)


def _redis_call(function, *args, **kwargs):
    from rtrl.api_keys import call_sync

    return call_sync(_redis_url(), function, *args, **kwargs)


def _authority():
    """The operator's signer of key records: the stack's own, or RTRL_API_KEY_SIGNING_KEY."""
    from rtrl.ops.stack_secrets import key_authority

    try:
        return key_authority(_state_dir())
    except (RuntimeError, PermissionError) as exc:
        err_console.print(f"[red]{exc}[/]")
        raise typer.Exit(1) from None


@keys_app.command("create")
def keys_create(
    client: str = typer.Argument(..., help="Client id the key belongs to."),
    events: str = typer.Option(
        "*",
        help="Comma-separated scopes: event types it may send "
        "(edit_shown, edit_outcome, persistence, followup, or * for all), "
        "and `completions` for the serving API (never implied by *).",
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
            issue_key, _authority(), client, scopes=set(events.split(",")), **budgets.issue_args()
        )
    except ValueError as exc:
        err_console.print(f"[red]{exc}[/]")
        raise typer.Exit(2) from None
    console.print(key)
    err_console.print(f"budgets: {budgets.describe()}")


@keys_app.command("rotate")
def keys_rotate(
    client: str = typer.Argument(...),
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
        console.print("[red]no such key[/]")
        raise typer.Exit(1)


@keys_app.command("list")
def keys_list(client: str = typer.Argument(...)) -> None:
    """A client's keys (hashes), scopes, limits and state."""
    from rich.table import Table

    from rtrl.api_keys import list_keys

    table = Table(
        "key sha256", "events", "rate/s", "burst", "in flight", "revoked", "expires (ms)",
        "created (ms)",
    )  # fmt: skip
    for row in _redis_call(list_keys, client):
        table.add_row(
            row["key_hash"][:16] + "…",
            row["scopes"],
            row["rate_per_s"],
            row["burst"],
            row.get("max_concurrency", "0"),
            row["revoked"],
            row["expires_ms"],
            row["created_ms"],
        )
    console.print(table)


def main() -> None:
    owner_only_files()  # reports, exports and anything else the CLI writes
    app()


if __name__ == "__main__":
    main()
