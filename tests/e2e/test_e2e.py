"""The whole loop on the embedded stack, started exactly as `rtrl up` starts it.

Product events go in; rewards come out; the trainer publishes versions; every worker
applies them; ClickHouse holds exactly what was sent — nothing lost, nothing doubled —
and `rtrl down` leaves no process behind. One run of the stack serves every test here:
the loop's accounting, each service's Prometheus endpoint, and one rollout's trace
followed from its serving span to the workers' apply spans.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
from rich.console import Console

from rtrl.bench.loop import live_times
from rtrl.heartbeat import IngestBeat, RewardStreamBeat, TrainerBeat
from rtrl.ops import health
from rtrl.ops.lifecycle import down, up
from rtrl.ops.reporting import drain, query_function
from rtrl.weight_sync import registry
from support import wait
from support.monitoring import expressions, metric_names, promtool

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@dataclass
class Run:
    stack: object
    stats: object
    query: object
    status_text: str
    status_json: str
    """What `rtrl status --json` printed after the drain."""
    metrics: dict[str, str]
    """Each service's /metrics page, scraped while the stack ran."""
    pids: list[int]
    scrapes: list[Scrape]
    """Every scrape of every service, under load and idle."""


# Prometheus's default scrape timeout: a page not served within it is a target down.
SCRAPE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Scrape:
    service: str
    phase: str
    """``load`` while the product ran, ``idle`` after the drain."""
    error: str = ""
    page: str = ""


@dataclass
class Scraper:
    """Scrapes every service of the stack in rounds, on its own thread, until stopped."""

    ports: dict[str, int]
    phase: str = "load"
    results: list[Scrape] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)

    def round(self) -> None:
        for service, port in self.ports.items():
            try:
                self.results.append(Scrape(service, self.phase, page=_scrape(port)))
            except OSError as exc:  # a timeout, a refused or reset connection
                self.results.append(Scrape(service, self.phase, repr(exc)))

    def run(self) -> None:
        while not self.stopping.wait(2.0):
            self.round()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Up, 45 s of simulated product, drain, scrape, down: once for the module."""
    from rtrl.ops.demo import run_product
    from rtrl.ops.status_view import render
    from support.trainer import install_warm_start

    state_dir = tmp_path_factory.mktemp("stack")
    install_warm_start(state_dir)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RTRL_STATE_DIR", str(state_dir))
        env.setenv("RTRL_STACK_INFERENCE_WORKERS", "2")
        console = Console(file=open(os.devnull, "w"))
        stack = up(state_dir, console)
        pids = [stack.supervisor_pid, *stack.infra.values(), *(s.pid for s in stack.services)]
        scraper = Scraper({spec.key: spec.ports["RTRL_METRICS_PORT"] for spec in stack.services})
        scraping = threading.Thread(target=scraper.run, daemon=True)
        scraping.start()
        try:
            stats = run_product(stack, 45, console, users=120, clients=16)
            scraper.stopping.set()
            scraping.join()
            drain(stack, stats, console, timeout_s=120)
            scraper.phase = "idle"
            for _ in range(3):
                scraper.round()
            screen = Console(record=True, width=200, file=open(os.devnull, "w"))
            screen.print(render(stack))
            status_json = subprocess.run(
                [sys.executable, "-m", "rtrl", "status", "--json"],
                capture_output=True,
                text=True,
                check=True,
                timeout=120,
            ).stdout
            scraped = {
                s.service: s.page for s in scraper.results if s.phase == "idle" and not s.error
            }
            yield Run(
                stack,
                stats,
                query_function(stack),
                screen.export_text(),
                status_json,
                scraped,
                pids,
                scraper.results,
            )
        finally:
            down(state_dir, console)
    assert not [pid for pid in pids if health.pid_alive(pid)], "rtrl down left processes behind"


def test_status_json_is_the_same_typed_view_for_scripts(run):
    status = json.loads(run.status_json)
    services = {spec.key for spec in run.stack.services}
    assert status["healthy"] is True
    assert {c["name"] for c in status["components"]} == services | {"tansu", "redis"}
    assert all(c["healthy"] for c in status["components"]), status["components"]
    # Lag per consumer group and topic. Not necessarily zero after the drain: the trainer
    # commits a reward's offset only with the step that trains on it, so a batch still
    # filling up is lag.
    assert {(row["group"], row["topic"]) for row in status["lag"]} >= {
        ("trainer", "rl.reward.v1"),
        ("analytics", "telemetry.rollout.v1"),
    }
    assert all(
        0 <= row["lag"] <= row["end"] and row["committed"] <= row["end"] for row in status["lag"]
    )
    trained = sum(row["committed"] for row in status["lag"] if row["group"] == "trainer")
    assert trained > 0, status["lag"]
    # Versions per worker and arm, and the trainer's step: the fleet serves what was published.
    workers = {w["worker"]: w["versions"] for w in status["workers"]}
    assert set(workers) == {s for s in services if s.startswith("inference:")}
    trainer = status["trainers"]["trainer:0"]
    # Beats are a second apart, so a worker may report a version the trainer's last beat did
    # not yet: both are bounded by what the registry holds once the status was read.
    client = redis.Redis.from_url(run.stack.redis_url_as("operator"))
    published = int(_bytes(client.get(registry.latest_key("treatment")) or b"-1"))
    client.close()
    assert trainer["step"] >= 2 and 0 < trainer["version"] <= published
    assert all(0 < v["treatment"] <= published and v["control"] == 0 for v in workers.values()), (
        workers,
        published,
    )
    assert status["trend"]["treatment"] and status["reward_fn_version"] == "r3"
    assert isinstance(status["alerts"], list) and isinstance(status["refusals"], list)


def _scrape(port: int) -> str:
    with urllib.request.urlopen(
        f"http://127.0.0.1:{port}/metrics", timeout=SCRAPE_TIMEOUT_S
    ) as response:
        return response.read().decode()


def _bytes(reply: bytes | str) -> bytes:
    """A redis reply: bytes, as the tests' clients do not decode responses (redis types it
    bytes | str)."""
    assert isinstance(reply, bytes), reply
    return reply


def _applied(redis_url: str) -> dict[int, dict[str, int]]:
    client = redis.Redis.from_url(redis_url)
    try:
        return {
            int(_bytes(k).decode().rsplit(":", 1)[1]): {
                _bytes(w).decode(): int(t) for w, t in client.hgetall(k).items()
            }
            for k in client.scan_iter("rtrl:applied:treatment:*")
        }
    finally:
        client.close()


@pytest.mark.timeout(900)
def test_loop_end_to_end(run):
    stack, stats, query, text = run.stack, run.stats, run.query, run.status_text
    # Every stage saw traffic.
    assert stats.completions > 50 and stats.errors == 0, stats.last_error
    assert stats.events_duplicate_replies > 0, (
        "the product's retries must reach the gateway as duplicates"
    )
    beats = {row.name: row.beat for row in health.check(stack)}
    ingest, joiner, trainer = beats["ingest:0"], beats["reward_stream:0"], beats["trainer:0"]
    assert isinstance(ingest, IngestBeat) and ingest.accepted > 0, ingest
    assert isinstance(joiner, RewardStreamBeat) and joiner.settled > 0, joiner
    assert isinstance(trainer, TrainerBeat) and trainer.step >= 2, trainer

    # `rtrl status` shows every component healthy, lag per group and topic, versions per worker.
    for spec in stack.services:
        assert spec.key in text
    assert "waiting" not in text
    for group in ("rtrl-reward-stream", "trainer", "analytics"):
        assert group in text
    assert "telemetry.rollout.v1" in text and "rl.reward.v1" in text

    # At least two new versions were published and went live on every worker.
    live = live_times(_applied(stack.redis_url_as("operator")))
    workers = {s.key for s in stack.services if s.name == "inference"}
    assert len([v for v in live if v > 0]) >= 2, live
    assert all(
        len(per_worker) == len(workers)
        for v, per_worker in _applied(stack.redis_url_as("operator")).items()
        if v in live
    )

    # ClickHouse holds exactly what was sent: nothing lost, nothing doubled.
    one = lambda sql: list(query(sql)[0].values())[0]
    rollouts = one("SELECT count() FROM rollouts FINAL")
    assert rollouts == stats.completions
    assert one("SELECT uniqExact(rollout_id) FROM rollouts") == stats.completions
    assert one("SELECT count() FROM telemetry_events FINAL") == stats.events_accepted
    assert one("SELECT count() FROM rewards FINAL WHERE topic = 'rl.reward.v1'") == rollouts
    assert one("SELECT uniqExact(rollout_id) FROM rewards WHERE topic = 'rl.reward.v1'") == rollouts
    # Privacy-mode users' events never reached a topic.
    assert stats.privacy_completions > 0 and stats.events_private > 0
    private = ", ".join(f"'{u}'" for u in stats.private_user_ids)
    assert one(f"SELECT count() FROM telemetry_events WHERE user_id IN ({private})") == 0
    assert one(f"SELECT count() FROM rollouts WHERE user_id IN ({private})") == 0

    # The stack's default reward (r3) pays nothing for asking instead of editing: no
    # drift towards clarifying questions (test_reward_hacking_e2e.py is the r1 side).
    from rtrl.ops.status_view import hacking_alerts

    assert stack.reward_fn_version == "r3"
    assert not [a for a in hacking_alerts(health.check(stack)) if a.metric == "clarifying_question"]


def test_every_service_serves_prometheus_metrics(run):
    """Each process's /metrics: Prometheus names (``_total`` counters, ``_seconds``
    and ``_bytes`` units) carrying the loop's throughput, errors, consumer lag, reward
    components, staleness, versions and swap pauses."""
    expected = {
        "ingest": [
            'rtrl_ingest_events_total{outcome="accepted"}',
            'rtrl_ingest_events_total{outcome="rejected"}',
            "rtrl_ingest_inflight",
        ],
        "inference": [
            "rtrl_inference_completions_total",
            "rtrl_inference_swaps_total",
            "rtrl_inference_swap_pause_seconds_total",
            'rtrl_inference_requests_total{outcome="unavailable"}',
            'rtrl_inference_policy_version{arm="treatment"}',
        ],
        "reward_stream": [
            'rtrl_reward_stream_outcomes_total{outcome="settled"}',
            "rtrl_reward_settled_total",
            "rtrl_reward_accumulated",
            'rtrl_reward_component_total{arm="treatment",component="persisted_fraction"}',
            'rtrl_reward_behaviour_total{arm="treatment",behaviour="trajectories"}',
            'rtrl_consumer_lag{group="rtrl-reward-stream"',
        ],
        "trainer": [
            'rtrl_trainer_steps_total{outcome="published"}',
            "rtrl_trainer_staleness_bucket",
            "rtrl_consumer_lag{",
        ],
        "weight_sync": [
            "rtrl_weight_sync_versions_published_total",
            'rtrl_weight_sync_latest_version{arm="treatment"}',
            "rtrl_weight_sync_sent_bytes_total",
        ],
        "analytics": ['rtrl_analytics_inserted_total{table="rewards"}', "rtrl_consumer_lag{"],
    }
    for spec in run.stack.services:
        page = run.metrics.get(spec.key, "")
        for series in expected[spec.name]:
            assert series in page, f"{spec.key}: no {series} in\n{page[:3000]}"
    samples = {key: _samples(page) for key, page in run.metrics.items()}
    assert (
        samples["ingest:0"]['rtrl_ingest_events_total{outcome="accepted"}']
        == run.stats.events_accepted
    )
    completions = sum(
        v
        for key, s in samples.items()
        if key.startswith("inference")
        for name, v in s.items()
        if name == "rtrl_inference_completions_total"
    )
    assert completions >= run.stats.completions
    assert samples["weight_sync:0"]["rtrl_weight_sync_versions_published_total"] >= 3


def test_every_scrape_answers_under_load_and_idle(run):
    """A scrape reads what each service already holds: it never waits on Kafka or on the
    thread that polls a consumer, so every service answers every scrape, busy or idle."""
    services = {spec.key for spec in run.stack.services}
    for phase in ("load", "idle"):
        answered = {s.service for s in run.scrapes if s.phase == phase and not s.error}
        assert answered == services, f"{phase}: no answer from {sorted(services - answered)}"
    failed = [s for s in run.scrapes if s.error]
    assert not failed, failed


# Metrics the alert rules or dashboards read that no process of the embedded stack exports.
EXPORTED_ELSEWHERE = {
    "up": "Prometheus writes it itself, for every target it scrapes",
    "rtrl_sglang_sidecar_policy_version": "the SGLang sidecar's (compose, on GPUs); "
    "the embedded stack serves with the torch engine and runs no sidecar",
    "rtrl_sdk_spool_events": "the Python SDK's, in the product process that embeds it",
    "rtrl_sdk_spool_bytes": "the Python SDK's, in the product process that embeds it",
    "rtrl_sdk_rejected_events_total": "the Python SDK's, in the product process that embeds it",
    "rtrl_sdk_spool_limit_bytes": "the Python SDK's, in the product process that embeds it",
}


def test_every_metric_the_alerts_and_dashboards_read_is_exported_and_lints_clean(run):
    """promtool's linter passes every service's page, and each metric named in an alert rule
    (deploy/prometheus) or a dashboard query (deploy/grafana) is a series some service of the
    stack exports, or is listed above with who exports it instead."""
    for key, page in run.metrics.items():
        linted = subprocess.run(
            [promtool(), "check", "metrics"], input=page, capture_output=True, text=True, timeout=60
        )
        assert linted.returncode == 0, f"{key}: {linted.stdout}{linted.stderr}"
    exported = {series.split("{")[0] for page in run.metrics.values() for series in _samples(page)}
    read = {where: metric_names(expr) for where, expr in expressions().items()}
    allowed = exported | set(EXPORTED_ELSEWHERE)
    missing = {where: sorted(names - allowed) for where, names in read.items() if names - allowed}
    assert not missing, f"{sorted(set().union(*map(set, missing.values())))} in {missing}"
    assert not set(EXPORTED_ELSEWHERE) & exported, "exported by the stack after all: unlist it"
    assert set(EXPORTED_ELSEWHERE) <= set().union(*read.values()), "listed but read by nothing"
    assert len(set().union(*read.values()) & exported) >= 40, (
        "too few names found: the parser broke"
    )


def _samples(page: str) -> dict[str, float]:
    out = {}
    for line in page.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _spans(state_dir) -> list[dict]:
    spans = []
    for path in sorted((state_dir / "otel").glob("*.spans.jsonl")):
        spans += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return spans


def _id(span: dict) -> tuple[str, str]:
    return span["context"]["trace_id"], span["context"]["span_id"]


def _service(span: dict) -> str:
    return span["resource"]["attributes"]["service.name"]


def _traceparent(span: dict) -> str:
    """The span's W3C traceparent without its flags (the JSON export leaves them out)."""
    trace_id, span_id = _id(span)
    return f"00-{trace_id[2:]}-{span_id[2:]}-"


def _chain(spans: list[dict], workers: int) -> list[dict] | None:
    """One rollout's spans from serving to every worker's apply, if the files hold one."""
    by_id = {_id(s): s for s in spans}
    children: dict[tuple[str, str], list[dict]] = {}
    for s in spans:
        if s["parent_id"]:
            children.setdefault((s["context"]["trace_id"], s["parent_id"]), []).append(s)
    for step in (
        s
        for s in spans
        if s["name"] == "trainer.step" and s["attributes"].get("rtrl.trainer.published")
    ):
        publish = next(
            (c for c in children.get(_id(step), []) if c["name"] == "weights publish"), None
        )
        commit = (
            next((c for c in children.get(_id(publish), []) if c["name"] == "weights commit"), None)
            if publish
            else None
        )
        applies = (
            [c for c in children.get(_id(commit), []) if c["name"] == "weights apply"]
            if commit
            else []
        )
        if len({a["attributes"]["rtrl.worker_id"] for a in applies}) < workers:
            continue
        for link in step["links"]:
            reward = by_id.get((link["context"]["trace_id"], link["context"]["span_id"]))
            serving = (
                by_id.get((reward["context"]["trace_id"], reward["parent_id"])) if reward else None
            )
            if serving is None or serving["name"] != "POST /v1/completions":
                continue
            events = [c for c in children.get(_id(serving), []) if c["name"] == "ingest publish"]
            if events:
                # Set, or there would be no applies (workers >= 1) and no serving span.
                assert reward is not None and publish is not None and commit is not None
                return [serving, *events, reward, step, publish, commit, *applies]
    return None


@pytest.mark.timeout(120)
def test_one_rollout_traced_from_serving_to_every_workers_apply(run):
    """The serving span (inference) is the trace's root; the client's events (ingest)
    and the reward (reward_stream) are its children; the training step (trainer)
    links to the reward; the version it shipped is committed (weight_sync) and applied
    (each inference worker) as its descendants; ClickHouse (analytics) keeps the
    serving span's and the step's traceparents."""
    workers = sum(1 for s in run.stack.services if s.name == "inference")
    state_dir = Path(run.stack.state_dir)
    chain = wait.until(
        lambda: _chain(_spans(state_dir), workers),
        "a rollout's trace that reaches every worker's apply span",
        timeout_s=60,
        interval_s=2,  # spans are exported every 5 s
    )
    assert chain is not None
    serving, *rest = chain
    services = [_service(s) for s in chain]
    assert services[0] == "rtrl-inference" and services[-1] == "rtrl-inference"
    assert {"rtrl-ingest", "rtrl-reward_stream", "rtrl-trainer", "rtrl-weight_sync"} <= set(
        services
    )
    rollout_id = serving["attributes"]["rtrl.rollout_id"]
    trace_id = serving["context"]["trace_id"]
    events = [s for s in rest if s["name"] == "ingest publish"]
    reward = next(s for s in rest if s["name"] == "reward settle")
    step = next(s for s in rest if s["name"] == "trainer.step")
    commit = next(s for s in rest if s["name"] == "weights commit")
    applies = [s for s in rest if s["name"] == "weights apply"]
    # One trace for the rollout, one for the step (a step has many rollouts: links).
    assert serving["kind"] == "SpanKind.SERVER" and serving["parent_id"] is None
    assert all(s["context"]["trace_id"] == trace_id for s in (*events, reward))
    assert reward["attributes"]["rtrl.rollout_id"] == rollout_id
    assert step["context"]["trace_id"] != trace_id
    assert {a["context"]["trace_id"] for a in applies} == {step["context"]["trace_id"]}
    version = commit["attributes"]["rtrl.policy.version"]
    assert {a["attributes"]["rtrl.policy.version"] for a in applies} == {version}
    assert step["attributes"]["rtrl.policy.version"] == version
    # Kafka spans follow the messaging semantic conventions.
    for span, topic in ((reward, "rl.reward.v1"),):
        assert span["kind"] == "SpanKind.PRODUCER"
        assert span["attributes"]["messaging.system"] == "kafka"
        assert span["attributes"]["messaging.destination.name"] == topic
    assert all(e["attributes"]["messaging.system"] == "kafka" for e in events)
    # Analytics: the rollout's row and the step's row carry the same trace context.
    one = lambda sql: list(run.query(sql)[0].values())[0]
    assert one(
        f"SELECT traceparent FROM rollouts FINAL WHERE rollout_id = '{rollout_id}'"
    ).startswith(_traceparent(serving))
    assert (
        one(
            "SELECT count() FROM trainer_steps FINAL"
            f" WHERE startsWith(traceparent, '{_traceparent(step)}') AND published"
        )
        == 1
    )


@pytest.mark.guarantee(7)
def test_each_secret_is_found_only_where_it_is_used(run):
    """Guarantee 7: each process holds only the secrets it uses. Every process environment
    and command line, every file the stack wrote, every heartbeat and every metrics page
    of the running stack is searched for each of its secrets."""
    from rtrl.ops import stack_secrets

    state_dir = Path(run.stack.state_dir)
    secrets = stack_secrets.load(state_dir)
    assert (
        secrets is not None
        and (state_dir / stack_secrets.SECRETS_FILE).stat().st_mode & 0o777 == 0o600
    )
    names = {value: name for name, value in vars(secrets).items()}

    def found_in(blob: bytes) -> set[str]:
        return {name for value, name in names.items() if value.encode() in blob}

    # Processes: each service holds exactly its own (its Redis password inside RTRL_REDIS_URL);
    # the supervisor, the broker and Redis none (Redis's ACL file holds only hashes).
    expected_by_pid = {spec.pid: stack_secrets.held_by(spec.name) for spec in run.stack.services}
    expected_by_pid |= {pid: set() for pid in (run.stack.supervisor_pid, *run.stack.infra.values())}
    for pid, expected in expected_by_pid.items():
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        assert found_in(environ) == expected, (
            f"pid {pid}: environment holds {found_in(environ)}, expected {expected}"
        )
        assert not found_in(Path(f"/proc/{pid}/cmdline").read_bytes())
        if pid in {spec.pid for spec in run.stack.services}:
            assert b"\0RTRL_KAFKA_BOOTSTRAP=" in b"\0" + environ, (
                "the stack's settings still reach every service"
            )
    # Every file the stack wrote (logs, spans, journal, checkpoint, blobs, Redis's file, chdb), but the secrets file.
    written = [
        p for p in state_dir.rglob("*") if p.is_file() and p.name != stack_secrets.SECRETS_FILE
    ]
    assert len(written) > 20
    leaks = {str(p.relative_to(state_dir)): found_in(p.read_bytes()) for p in written}
    assert not {path: found for path, found in leaks.items() if found}
    # ...and only the owner can read them (the warm-start cache is the test's own copy).
    readable = [
        str(p.relative_to(state_dir))
        for p in written
        if p.stat().st_mode & 0o077 and "cache" not in p.parts
    ]
    assert not readable, f"readable by others than the owner: {readable[:10]}"
    # Heartbeats and every metrics page.
    client = redis.Redis.from_url(run.stack.redis_url_as("operator"))
    beats = b"".join(_bytes(client.get(key) or b"") for key in client.scan_iter("rtrl:hb:*"))
    client.close()
    assert beats and not found_in(beats)
    assert run.metrics and not found_in("".join(run.metrics.values()).encode())


@pytest.mark.guarantee(7)
def test_the_stacks_redis_answers_only_its_own_users(run):
    """Guarantee 7 for `rtrl up`'s Redis (issue 24): a local client without a password is
    refused what would wipe the registry or list and reconfigure everything; stack.json says
    where Redis listens but holds no password; each service runs as its own Redis user
    (ops/redis_acl.py; tests/ops/test_redis_acl.py attacks each user's keys)."""
    import urllib.parse

    anonymous = redis.Redis.from_url(run.stack.redis_url)
    try:
        for command in (
            ("DEL", "rtrl:ws:treatment:latest"),
            ("KEYS", "*"),
            ("CONFIG", "GET", "*"),
            ("HSET", "rtrl:ingest:key:minted", "client_id", "attacker"),
        ):
            with pytest.raises(redis.exceptions.AuthenticationError):  # NOAUTH
                anonymous.execute_command(*command)
    finally:
        anonymous.close()
    written = json.loads((Path(run.stack.state_dir) / "stack.json").read_text())
    assert urllib.parse.urlsplit(written["redis_url"]).password is None
    for spec in run.stack.services:
        environ = Path(f"/proc/{spec.pid}/environ").read_bytes().split(b"\0")
        (url,) = [v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"RTRL_REDIS_URL=")]
        assert urllib.parse.urlsplit(url).username == spec.name, f"{spec.key} runs as {url}"
