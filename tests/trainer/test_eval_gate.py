"""The eval gate: a candidate that regresses the held-out suite is never published.

The integration test runs the real Trainer loop against a Tansu broker and a
weight_sync server, with a worker following the treatment arm exactly as an
inference worker does. Rewards that pay for broken code, at a learning rate ten
times the default, make a harmful update (one step of it halves the share of
well-formed completions); the gate must refuse it, restore the
published weights, show the refusal with its scores, and never let a byte of it
reach the worker. Benign rewards afterwards ship as usual, from the restored state.
"""

from __future__ import annotations

import copy
import queue
import threading
import time

import pytest
import torch
from rich.console import Console

from rtrl.ops.health import ComponentHealth
from rtrl.policy import PolicyConfig, build_model, load_weights
from rtrl.simulator.suite import DemoSuite
from rtrl.trainer.evaluation import EvalGate, EvalScores
from rtrl.trainer.journal import Journal
from support import signed, wait
from support.trainer import DEMO_PLUGINS
from support.weight_sync import MANIFEST_KEY, MANIFEST_PUBLIC_KEYS, Following


def test_suite_scores_are_reproducible_and_the_checkers_tell_good_from_broken():
    from support.trainer import warm_model

    torch.set_num_threads(1)
    suite = DemoSuite(64)
    warm = warm_model()
    first, again = suite.score(warm), suite.score(warm)
    assert first == again, "common random numbers: the same weights must score the same"
    assert first["well_formed"] > 0.8
    untrained = suite.score(build_model(PolicyConfig()))
    assert untrained["well_formed"] == 0 and untrained["house_style"] == 0


@pytest.mark.guarantee(6)
def test_gate_refuses_a_regression_beyond_tolerance_against_either_reference():
    from support.trainer import warm_model

    torch.set_num_threads(1)
    suite = DemoSuite(32)
    warm = warm_model()
    scores = suite.score(warm)
    gate = EvalGate(suite, 0.1, control=scores, published=scores)
    assert gate.judge(warm).accepted
    broken = copy.deepcopy(warm)
    with torch.no_grad():
        broken.lm_head.weight.mul_(-1)
    verdict = gate.judge(broken)
    assert not verdict.accepted
    assert any(r.startswith("well_formed vs published") for r in verdict.regressions)
    assert any(r.startswith("well_formed vs control") for r in verdict.regressions)
    # Within tolerance of the published version but too far below control: still refused.
    low = EvalScores(
        scores={**scores.scores, "well_formed": scores["well_formed"] + 0.5}, samples=32
    )
    drifted = EvalGate(suite, 0.1, control=low, published=scores).judge(warm)
    assert not drifted.accepted and drifted.regressions == (
        f"well_formed vs control: {scores['well_formed']:.3f} < {low['well_formed']:.3f} - 0.1",
    )
    with pytest.raises(ValueError, match="tolerance"):
        EvalGate(suite, 1.5, control=scores, published=scores)


def _trainer_steps_in_clickhouse(stack_settings, tmp_path) -> list[dict]:
    """Read the trainer-steps topic back and put it through the analytics sink into chdb."""
    from confluent_kafka import Consumer

    from rtrl import topics
    from rtrl.analytics import schema
    from rtrl.analytics.query import client_query_fn, connect
    from rtrl.analytics.rows import KafkaRecord
    from rtrl.config import StackSettings
    from rtrl.kafka import consumer_config, record_headers, record_position

    consumer = Consumer(consumer_config(stack_settings, "test-trainer-steps"))
    consumer.subscribe([topics.TRAINER_STEPS])
    records: list[KafkaRecord] = []
    deadline = time.monotonic() + 30
    while len(records) < 3 and time.monotonic() < deadline:
        for message in consumer.consume(10, timeout=0.5):
            assert message.error() is None, message.error()
            topic, partition, offset = record_position(message)
            records.append(
                KafkaRecord(
                    topic,
                    partition,
                    offset,
                    message.key(),
                    message.value(),
                    record_headers(message),
                )
            )
    consumer.close()
    client = connect(StackSettings(state_dir=tmp_path / "analytics"))
    schema.create_tables(client)
    # A stand-in for the consumer: the sink only commits through it here.
    sink = signed.checking_sink(client)
    for record in records:
        sink.add(record)
    sink.flush()
    return client_query_fn(client)(f"SELECT * FROM {schema.TRAINER_STEPS} FINAL ORDER BY step")


def _metric_points(reader, name: str) -> dict[tuple, float]:
    """Sum of a counter's points by attribute values."""
    out: dict[tuple, float] = {}
    for resource_metrics in reader.get_metrics_data().resource_metrics:
        for scope in resource_metrics.scope_metrics:
            for metric in scope.metrics:
                if metric.name == name:
                    for point in metric.data.data_points:
                        key = tuple(point.attributes.values())
                        out[key] = out.get(key, 0) + point.value
    return out


@pytest.mark.guarantee(6)
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_harmful_update_is_refused_and_never_reaches_a_worker(
    stack_settings, server, otel_memory, tmp_path
):
    from confluent_kafka import Consumer, Producer

    from rtrl.kafka import consumer_config, producer_config
    from rtrl.ops.status_view import refusals_table, workers_table
    from rtrl.trainer.config import TrainerSettings
    from rtrl.trainer.loop import CONTROL, TREATMENT, Trainer
    from rtrl.trainer.metrics import StepExporter
    from rtrl.trainer.service import fetch_published
    from rtrl.weight_sync.client import Publisher, Subscriber
    from support.trainer import (
        install_warm_start,
        produce,
        reward_record,
        sampled_rollouts,
        warm_model,
    )
    from support.weight_sync import SUBSCRIBE_TOKEN

    torch.set_num_threads(1)
    install_warm_start(stack_settings.state_dir)
    token = stack_settings.weight_sync_token.get_secret_value()
    publishers = {
        arm: Publisher(server.addr, token, arm, signing_key=MANIFEST_KEY)
        for arm in (CONTROL, TREATMENT)
    }
    settings = TrainerSettings.model_validate(
        {**DEMO_PLUGINS, "lr": 1e-3, "batch_size": 32, "min_batch": 32}
        | {"max_staleness": 100, "eval_tolerance": 0.1}
    )
    exporter = StepExporter(Producer(producer_config(stack_settings)), signed.STEP_SIGNER)
    spans, reader = otel_memory
    spans.clear()
    trainer = Trainer(
        settings,
        stack_settings.state_dir,
        Consumer(consumer_config(stack_settings, settings.consumer_group)),
        publishers,
        fetch_weights=lambda arm, version: fetch_published(
            server.addr, token, arm, version, MANIFEST_PUBLIC_KEYS
        ),
        on_step=exporter,
    )
    trainer.start()
    assert trainer.version == 0
    stop = threading.Event()
    loop = threading.Thread(target=trainer.run, args=(stop,), daemon=True)
    loop.start()
    worker = Following(
        Subscriber(
            server.addr,
            TREATMENT,
            "inference-0",
            token=SUBSCRIBE_TOKEN,
            public_keys=MANIFEST_PUBLIC_KEYS,
        )
    )
    try:
        v0, v0_weights = worker.next()
        assert v0.version == 0

        # Pay for exactly the completions that do not parse. The warm start answers about
        # 9 tasks in 10 well, and a batch whose rewards are all equal carries no gradient:
        # each batch of 32 gets 4 of the malformed ones, and one batch goes in at a time
        # (so the partitions' interleaving cannot put them all in one).
        pool = sampled_rollouts(warm_model(), 256, seed=11)
        good, bad = [row for row in pool if row[4]], [row for row in pool if not row[4]]
        assert len(bad) >= 12 and len(good) >= 84, (
            f"{len(bad)} malformed of {len(pool)}: the warm start changed"
        )
        batches = [bad[4 * i : 4 * i + 4] + good[28 * i : 28 * i + 28] for i in range(3)]
        poisoned = []
        for i, batch in enumerate(batches[:2]):
            poisoned += [reward_record(*row[:4], reward=0.0 if row[4] else 1.0) for row in batch]
            produce(stack_settings.kafka_bootstrap, poisoned[-32:])
            wait.until(
                lambda: trainer.heartbeat().refused,
                f"refusal {i + 1}",
                ready=wait.at_least(i + 1),
                timeout_s=120,
            )

        status = trainer.heartbeat()
        assert trainer.publishers[TREATMENT].latest() == 0
        assert status.version == 0 and status.step == 2
        for refusal in status.refusals:
            assert refusal.accepted is False and refusal.rollouts == 32
            assert refusal.candidate["well_formed"] < refusal.published["well_formed"] - 0.1
            assert any(r.startswith("well_formed vs published") for r in refusal.regressions)
        with pytest.raises(queue.Empty):
            worker.next(timeout_s=2)
        # The refused weights were put back: the model is v0 again, bit for bit.
        for name, tensor in v0_weights.items():
            assert torch.equal(trainer.learner.model.state_dict()[name], tensor), name
        replayed = Journal(stack_settings.state_dir / "trainer").replay(0)
        assert set(replayed.refused) == {r.rollout_id for r in poisoned} and replayed.trained == ()

        # `rtrl status` shows the refusals with their scores.
        screen = Console(record=True, width=220, file=open("/dev/null", "w"))
        rows_shown = [ComponentHealth("trainer:0", True, "", status)]
        screen.print(workers_table(rows_shown))
        screen.print(refusals_table(status.refusals))
        text = screen.export_text()
        assert "eval gate refused 2" in text
        assert (
            "well_formed vs published" in text
            and f"{status.refusals[0].candidate['well_formed']:.3f}" in text
        )

        # Honest rewards (the same rollouts, paid for parsing) at the default learning rate ship,
        # built on v0, not on a refused candidate. (Any first Adam step at 1e-3 is too big for this model.)
        for group in trainer.learner.optimizer.param_groups:
            group["lr"] = TrainerSettings().lr
        honest = [reward_record(*row[:4], reward=1.0 if row[4] else 0.0) for row in batches[2]]
        produce(stack_settings.kafka_bootstrap, honest)
        v1, v1_weights = worker.next(timeout_s=120)
        assert (v1.version, v1.train_step, v1.rollouts_trained) == (1, 3, 32)
        model = build_model(PolicyConfig())
        load_weights(model, v1_weights)
        assert (
            DemoSuite(settings.eval_tasks).score(model)["well_formed"]
            >= status.refusals[0].published["well_formed"] - 0.1
        )

        # Every judged candidate has a step record in ClickHouse and a span and metrics in OpenTelemetry.
        exporter.flush()
        assert exporter.failed == 0
        steps = _trainer_steps_in_clickhouse(stack_settings, tmp_path)
        assert [(s["step"], s["published"], s["version"], s["rollouts"]) for s in steps] == [
            (1, False, -1, 32),
            (2, False, -1, 32),
            (3, True, 1, 32),
        ]
        for row in steps:
            assert row["staleness"] == {0: 32} and row["eval_candidate"].keys() == {
                "well_formed",
                "house_style",
            }
            assert row["grad_norm"] > 0 and row["entropy"] > 0 and row["tokens"] > 32
            assert bool(row["eval_regressions"]) is not row["published"]
        assert steps[0]["eval_candidate"]["well_formed"] == pytest.approx(
            status.refusals[0].candidate["well_formed"]
        )
        step_spans = [span for span in spans.get_finished_spans() if span.name == "trainer.step"]
        assert [span.attributes["rtrl.trainer.published"] for span in step_spans] == [
            False,
            False,
            True,
        ]
        assert {row["traceparent"].split("-")[2] for row in steps} == {
            f"{span.context.span_id:016x}" for span in step_spans
        }
        outcomes = _metric_points(reader, "rtrl.trainer.steps")
        assert outcomes[("refused",)] >= 2 and outcomes[("published",)] >= 1
    finally:
        stop.set()
        loop.join(timeout=30)
        worker.subscriber.close()
        trainer.intake.consumer.close()
        for publisher in publishers.values():
            publisher.close()
