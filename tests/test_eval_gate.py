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
from weight_sync_support import Following

from rtrl.health import ComponentHealth
from rtrl.policy import PolicyConfig, build_model, load_weights
from trainer.evaluation import EvalGate, EvalScores, EvalSuite
from trainer.journal import Journal


def test_suite_scores_are_reproducible_and_the_checkers_tell_good_from_broken():
    from trainer_support import warm_model

    torch.set_num_threads(1)
    suite = EvalSuite(64)
    warm = warm_model()
    first, again = suite.score(warm), suite.score(warm)
    assert first == again, "common random numbers: the same weights must score the same"
    assert first.well_formed > 0.8
    untrained = suite.score(build_model(PolicyConfig()))
    assert untrained.well_formed == 0 and untrained.house_style == 0


def test_gate_refuses_a_regression_beyond_tolerance_against_either_reference():
    from trainer_support import warm_model

    torch.set_num_threads(1)
    suite = EvalSuite(32)
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
    low = EvalScores(well_formed=scores.well_formed + 0.5, house_style=scores.house_style, samples=32)
    drifted = EvalGate(suite, 0.1, control=low, published=scores).judge(warm)
    assert not drifted.accepted and drifted.regressions == (
        f"well_formed vs control: {scores.well_formed:.3f} < {low.well_formed:.3f} - 0.1",
    )
    with pytest.raises(ValueError, match="tolerance"):
        EvalGate(suite, 1.5, control=scores, published=scores)


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_harmful_update_is_refused_and_never_reaches_a_worker(stack_settings, server):
    from confluent_kafka import Consumer
    from trainer_support import install_warm_start, produce, reward_record, sampled_rollouts, warm_model
    from weight_sync_support import SUBSCRIBE_TOKEN

    from rtrl.kafka import consumer_config
    from rtrl.status_view import refusals_table, workers_table
    from trainer.config import TrainerSettings
    from trainer.loop import CONTROL, TREATMENT, Trainer
    from trainer.service import fetch_published
    from weight_sync.client import Publisher, Subscriber

    torch.set_num_threads(1)
    install_warm_start(stack_settings.state_dir)
    token = stack_settings.weight_sync_token.get_secret_value()
    publishers = {arm: Publisher(server.addr, token, arm) for arm in (CONTROL, TREATMENT)}
    settings = TrainerSettings(lr=1e-3, batch_size=32, min_batch=32, max_staleness=100, eval_tolerance=0.1)
    trainer = Trainer(
        settings,
        stack_settings.state_dir,
        Consumer(consumer_config(stack_settings, settings.consumer_group)),
        publishers,
        fetch_weights=lambda arm, version: fetch_published(server.addr, token, arm, version),
    )
    trainer.start()
    assert trainer.version == 0
    stop = threading.Event()
    loop = threading.Thread(target=trainer.run, args=(stop,), daemon=True)
    loop.start()
    worker = Following(Subscriber(server.addr, TREATMENT, "inference-0", token=SUBSCRIBE_TOKEN))
    try:
        v0, v0_weights = worker.next()
        assert v0.version == 0

        # Pay for exactly the completions that do not parse.
        rows = sampled_rollouts(warm_model(), 64, seed=11)
        assert 0 < sum(row[4] for row in rows) < len(rows)
        poisoned = [reward_record(*row[:4], reward=0.0 if row[4] else 1.0) for row in rows]
        produce(stack_settings.kafka_bootstrap, poisoned)
        _wait(lambda: trainer.status.refused == 2, 120, "two refusals")

        status = trainer.heartbeat()
        assert trainer.publishers[TREATMENT].latest() == 0
        assert status["version"] == 0 and status["step"] == 2
        for refusal in status["refusals"]:
            assert refusal["accepted"] is False and refusal["rollouts"] == 32
            assert refusal["candidate"]["well_formed"] < refusal["published"]["well_formed"] - 0.1
            assert any(r.startswith("well_formed vs published") for r in refusal["regressions"])
        with pytest.raises(queue.Empty):
            worker.next(timeout_s=2)
        # The refused weights were put back: the model is v0 again, bit for bit.
        for name, tensor in v0_weights.items():
            assert torch.equal(trainer.model.state_dict()[name], tensor), name
        replayed = Journal(stack_settings.state_dir / "trainer").replay(0)
        assert set(replayed.refused) == {r.rollout_id for r in poisoned} and replayed.trained == ()

        # `rtrl status` shows the refusals with their scores.
        screen = Console(record=True, width=220, file=open("/dev/null", "w"))
        rows_shown = [ComponentHealth("trainer:0", True, "", status)]
        screen.print(workers_table(rows_shown))
        screen.print(refusals_table(status["refusals"]))
        text = screen.export_text()
        assert "eval gate refused 2" in text
        assert "well_formed vs published" in text and f"{status['refusals'][0]['candidate']['well_formed']:.3f}" in text

        # Honest rewards (the same rollouts, paid for parsing) at the default learning rate ship,
        # built on v0, not on a refused candidate. (Any first Adam step at 1e-3 is too big for this model.)
        for group in trainer.optimizer.param_groups:
            group["lr"] = TrainerSettings().lr
        honest = [reward_record(*row[:4], reward=1.0 if row[4] else 0.0) for row in rows[:32]]
        produce(stack_settings.kafka_bootstrap, honest)
        v1, v1_weights = worker.next(timeout_s=120)
        assert (v1.version, v1.train_step, v1.rollouts_trained) == (1, 3, 32)
        model = build_model(PolicyConfig())
        load_weights(model, v1_weights)
        assert EvalSuite(settings.eval_tasks).score(model).well_formed >= status["refusals"][0]["published"]["well_formed"] - 0.1
    finally:
        stop.set()
        loop.join(timeout=30)
        worker.subscriber.close()
        trainer.consumer.close()
        for publisher in publishers.values():
            publisher.close()
