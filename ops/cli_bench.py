"""`rtrl bench NAME`: each benchmark writes bench/results/<name>.json (and a plot where one
helps); ``--json`` prints that document on stdout too, the progress going to stderr."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import typer
from rich.console import Console

from rtrl.ops.cli_common import JSON_OPTION, console, err_console, print_json, state_dir

bench_app = typer.Typer(
    help="Benchmarks; each writes bench/results/<name>.json (--json prints it too).",
    no_args_is_help=True,
)


def _bench(as_json: bool, out: Path, run: Callable[[Console], object]) -> None:
    """Run one bench with its progress on stdout, or on stderr and its results as JSON on stdout."""
    run(err_console if as_json else console)
    if as_json:
        print_json(json.loads(out.read_text()))


@bench_app.command("loop")
def bench_loop(
    minutes: float = typer.Option(2.0, help="How long the product drives the loop."),
    product: str = typer.Option("edits", help="edits (single-turn) or agent (trajectories)."),
    out: Path | None = typer.Option(None, help="Default: bench/results/loop[-agent].json."),
    as_json: bool = JSON_OPTION,
) -> None:
    """Event-to-live latency: last event of a version's newest rollout until every worker serves it."""
    from rtrl.bench.loop import run

    if product not in ("agent", "edits"):
        raise typer.BadParameter("agent or edits", param_hint="--product")
    default = Path(
        "bench/results/loop.json" if product == "edits" else "bench/results/loop-agent.json"
    )
    path = out or default
    _bench(as_json, path, lambda c: run(state_dir(), minutes * 60, path, c, product))


@bench_app.command("codec")
def bench_codec(
    out: Path = typer.Option(Path("bench/results/codec.json"), help="Where the results go."),
    as_json: bool = JSON_OPTION,
) -> None:
    """Delta size and speed on real deltas (MiniLM fine-tune in bf16, a demo policy step)."""
    from rtrl.bench.codec import run

    _bench(as_json, out, lambda c: run(out, c))


@bench_app.command("broadcast")
def bench_broadcast(
    rounds: int = typer.Option(15, help="Deltas timed per topology."),
    out: Path = typer.Option(Path("bench/results/broadcast.json"), help="Where the results go."),
    as_json: bool = JSON_OPTION,
) -> None:
    """Time for one new version to reach 1, 2, 4 and 8 subscriber processes, direct and through relays."""
    from rtrl.bench.broadcast import run

    _bench(as_json, out, lambda c: run(out, c, rounds=rounds))


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
    out: Path = typer.Option(Path("bench/results/join.json"), help="Where the results go."),
    as_json: bool = JSON_OPTION,
) -> None:
    """Reward-join events/s against a faust floor, 2 workers vs 1, settle latency; 4k/32k agents."""
    from rtrl.bench.join import run

    _bench(
        as_json,
        out,
        lambda c: run(
            out,
            c,
            rollouts=rollouts,
            spacing_ms=spacing_ms,
            live_rollouts=live_rollouts,
            live_rate_per_s=live_rate,
            rounds=rounds,
            trajectory_rollouts=trajectory_rollouts,
        ),
    )


@bench_app.command("engine")
def bench_engine(
    concurrency: int = typer.Option(
        8, help="Requests in flight at once (and HF generate()'s batch)."
    ),
    max_tokens: int = typer.Option(48, help="Tokens per completion, on both sides."),
    phase_s: float = typer.Option(10.0, help="Seconds per measured phase."),
    turns: int = typer.Option(20, help="Turns per agent in the multi-turn workload (0: skip it)."),
    out: Path = typer.Option(Path("bench/results/engine.json"), help="Where the results go."),
    as_json: bool = JSON_OPTION,
) -> None:
    """Engine tokens/s against HF generate() on the same model and prompts, the slowdown while
    versions arrive, and an agent's turns with its keys and values kept against re-sent."""
    from rtrl.bench.engine import run

    multi_turn = (3, turns, 50, 200) if turns else None
    _bench(
        as_json,
        out,
        lambda c: run(
            out,
            c,
            concurrency=concurrency,
            max_tokens=max_tokens,
            phase_s=phase_s,
            turns=multi_turn,
        ),  # fmt: skip
    )


@bench_app.command("trainer")
def bench_trainer(
    batch: int = typer.Option(64, help="Rollouts per training step."),
    steps: int = typer.Option(10, help="Steps per side per round (3 rounds, alternating)."),
    out: Path = typer.Option(Path("bench/results/trainer.json"), help="Where the results go."),
    as_json: bool = JSON_OPTION,
) -> None:
    """Training-step tokens/s against a bare torch loop doing the same forward/backward on the same batch."""
    from rtrl.bench.trainer import run

    _bench(as_json, out, lambda c: run(out, c, batch_size=batch, steps=steps))


@bench_app.command("trainer-memory")
def bench_trainer_memory(
    out: Path = typer.Option(
        Path("bench/results/trainer_memory.json"), help="Where the results go."
    ),
    as_json: bool = JSON_OPTION,
) -> None:
    """The trainer's peak memory on 4k and 32k-token trajectories, and what micro-batches save."""
    from rtrl.bench.trainer_memory import run

    _bench(as_json, out, lambda c: run(out, c))


@bench_app.command("ingest")
def bench_ingest(
    events: int = typer.Option(60_000, help="Events per round and side."),
    batch: int = typer.Option(500, help="Events per gateway request."),
    concurrency: int = typer.Option(8, help="Gateway requests in flight."),
    rounds: int = typer.Option(3, help="Alternating rounds; the best of each side is reported."),
    out: Path = typer.Option(Path("bench/results/ingest.json"), help="Where the results go."),
    as_json: bool = JSON_OPTION,
) -> None:
    """Events/s through the gateway against a bare confluent-kafka producer on the same broker."""
    from rtrl.bench.ingest import run

    _bench(
        as_json,
        out,
        lambda c: run(
            out, c, events_per_round=events, batch=batch, concurrency=concurrency, rounds=rounds
        ),
    )


@bench_app.command("serving-abuse")
def bench_serving_abuse(
    over_context: int = typer.Option(2_000, help="Over-context first turns from one default key."),
    dropped: int = typer.Option(500, help="Streams it drops after their first token."),
    drop_rate: float = typer.Option(20.0, help="Dropped streams per second beside the probes."),
    probes: int = typer.Option(100, help="The neighbour's agents per phase (3 requests each)."),
    out: Path = typer.Option(
        Path("bench/results/serving_abuse.json"), help="Where the results go."
    ),
    as_json: bool = JSON_OPTION,
) -> None:
    """One default key's refused turns and dropped streams against another client's agent."""
    from rtrl.bench.serving_abuse import run

    _bench(
        as_json,
        out,
        lambda c: run(
            out,
            c,
            over_context=over_context,
            dropped=dropped,
            drop_rate_per_s=drop_rate,
            probes=probes,
        ),  # fmt: skip
    )
