"""The worker's counters as OpenTelemetry (and so Prometheus) metrics, read from the
engine, the request counters and the weight followers when metrics are collected."""

from __future__ import annotations

from collections.abc import Sequence, Sized

from opentelemetry import metrics
from opentelemetry.metrics import Meter

from rtrl import otel
from rtrl.inference.completions import RequestCounters
from rtrl.inference.engine import Engine
from rtrl.inference.sglang_adapter import SGLangEngine
from rtrl.inference.weights import WeightFollower


def observe(
    engine: Engine | SGLangEngine,
    counters: RequestCounters,
    followers: Sequence[WeightFollower],
    sessions: Sized = (),
) -> None:
    """``sessions``: the worker's open trajectories (inference/sessions.py)."""
    meter = metrics.get_meter("rtrl.inference")
    _observe_engine(meter, engine)
    otel.observe(
        meter,
        "rtrl.inference.requests",
        "counter",
        lambda: [
            (counters.records, {"outcome": "recorded"}),
            (counters.private, {"outcome": "private"}),
            (counters.rejected, {"outcome": "rejected"}),
            (counters.unavailable, {"outcome": "unavailable"}),
            (counters.unrecorded, {"outcome": "unrecorded"}),
            (counters.trajectory_turns, {"outcome": "trajectory_turn"}),
            (counters.dropped, {"outcome": "dropped"}),
        ],
        unit="{request}",
        description="Completion requests by outcome "
        "(rejected: 400, unavailable: 503, unrecorded: served, kept from training; "
        "trajectory_turn: an agent's turn, recorded with its trajectory; "
        "dropped: a stream whose client went away, its generation aborted)",
    )
    otel.observe(
        meter,
        "rtrl.inference.trajectories.open",
        "gauge",
        lambda: [(len(sessions), {})],
        unit="{trajectory}",
        description="Agents' trajectories this worker holds open (their records unwritten)",
    )
    otel.observe(
        meter,
        "rtrl.inference.weights.refused",
        "counter",
        lambda: [(sum(f.refused for f in followers), {})],
        unit="{version}",
        description="Weight versions refused because the trainer did not sign their manifest",
    )


def _observe_engine(meter: Meter, engine: Engine | SGLangEngine) -> None:
    stats = engine.stats
    for name, unit, description in (
        ("completions", "{completion}", "Completions finished"),
        ("tokens", "{token}", "Tokens sampled"),
        ("swaps", "{swap}", "Weight versions swapped in"),
        ("aborted", "{request}", "Requests aborted unfinished (their client went away)"),
    ):
        otel.observe(
            meter,
            f"rtrl.inference.{name}",
            "counter",
            _reading(stats, name),
            unit=unit,
            description=description,
        )
    otel.observe(
        meter,
        "rtrl.inference.swap.pause",
        "counter",
        lambda: [(stats.swap_pause_s, {})],
        unit="s",
        description="Time decoding stood still for weight swaps",
    )
    otel.observe(
        meter,
        "rtrl.inference.policy.version",
        "gauge",
        lambda: [(v, {"arm": arm}) for arm, v in engine.versions().items()],
        description="Policy version each arm serves (-1: none yet)",
    )
    otel.observe(
        meter,
        "rtrl.inference.queue_depth",
        "gauge",
        lambda: [(engine.queue_depth(), {})],
        unit="{request}",
        description="Requests waiting for the engine",
    )


def _reading(stats: object, name: str) -> otel.Reading:
    """The metric reading of ``stats.<name>``, taken at every collection."""
    return lambda: [(getattr(stats, name), {})]
