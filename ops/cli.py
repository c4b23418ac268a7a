"""The `rtrl` command line: run the embedded stack, watch it, drive it, report on it.

Heavy imports (torch, faust, chdb) happen inside commands, so `--help` is instant.
"""

from __future__ import annotations

import time
from pathlib import Path

import typer

from rtrl import __version__
from rtrl.ops.cli_bench import bench_app
from rtrl.ops.cli_common import (
    FAILED,
    JSON_OPTION,
    USAGE,
    console,
    err_console,
    print_json,
    require_stack,
    state_dir,
)
from rtrl.ops.cli_keys import keys_app
from rtrl.runtime import owner_only_files

app = typer.Typer(
    help="rtrl: real-time reinforcement learning from product telemetry. "
    "Exit codes: 0 done, 1 could not (no stack, a failed start, nothing found), 2 bad usage "
    "or input (docs/cli.md).",
    no_args_is_help=True,
)
app.add_typer(bench_app, name="bench")
app.add_typer(keys_app, name="keys")
model_app = typer.Typer(help="Model directories: a tiny random one to try `rtrl up --model` on.")
app.add_typer(model_app, name="model")


def _print_version(asked: bool) -> None:
    if asked:
        typer.echo(f"rtrl {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(
        False,
        "--version",
        help="Print rtrl's version and exit.",
        callback=_print_version,
        is_eager=True,
    ),
) -> None:
    pass


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
        err_console.print(f"[red]unknown family {family!r}[/]: one of {', '.join(FAMILIES)}")
        raise typer.Exit(USAGE)
    console.print(f"wrote {write_tiny_checkpoint(out_dir, family, seed=seed)}")


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
        stack = start(state_dir(), console, fresh=fresh, model_dir=model)
    except StackError as exc:
        err_console.print(f"[red]{exc}[/]")
        raise typer.Exit(FAILED) from None
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

    stop(state_dir(), console)


@app.command()
def status(
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh every second until Ctrl-C."),
    as_json: bool = typer.Option(
        False,
        "--json",
        help="Print the status as one JSON object (rtrl.ops.status_view.StackStatus) for scripts.",
    ),
) -> None:
    """Health of every component, consumer lag per topic, policy version per worker,
    reward-hacking alerts."""
    from rich.live import Live

    from rtrl.ops import status_view
    from rtrl.ops.status_view import render

    stack = require_stack()
    if as_json:
        print_json(status_view.as_json(status_view.collect(stack)))
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
        help="agent: an agent harness calling tools over several turns (reward a2); edits: "
        "the single-turn product (reward r3).",
    ),
    reward_fn: str | None = typer.Option(
        None,
        help="Reward function to settle with (sets RTRL_STACK_REWARD_FN_VERSION). r1 pays for "
        "asking instead of editing; a1h and a2h let a broken tool call discard a rollout; a1 "
        "weighs a complaint at half a kept edit.",
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
        state_dir(),
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
    as_json: bool = JSON_OPTION,
) -> None:
    """The A/B table (edits persisted, dissatisfied follow-ups, latency) per arm, the agents
    per policy version, and an HTML report (with reports/ab.json beside it)."""
    from rtrl.ops.health import running_stack
    from rtrl.ops.reporting import print_report

    stack = running_stack(state_dir())
    if stack is not None:
        err_console.print(f"reading the stack in {stack.state_dir} ({stack.clickhouse_url})")
    else:
        err_console.print(f"no stack running: reading the analytics kept in {state_dir()}")
    found = print_report(
        stack, err_console if as_json else console, html=html, state_dir=state_dir()
    )
    if as_json:
        print_json(found.as_json())
    if not found.rows:
        raise typer.Exit(FAILED)


def main() -> None:
    owner_only_files()  # reports, exports and anything else the CLI writes
    app()


if __name__ == "__main__":
    main()
