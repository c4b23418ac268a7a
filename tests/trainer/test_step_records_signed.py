"""The trainer signs every TrainerStep it writes (the analytics sink stores only steps that
verify, and the training report reads them), with its manifest key for a purpose of its own."""

from __future__ import annotations

import pytest
from confluent_kafka import Producer

from rtrl import signing, topics
from rtrl.kafka import producer_config, record_headers
from rtrl.trainer.metrics import StepExporter
from rtrl.v1 import trainer_pb2
from support import signed
from support.reward_stream import read_all
from support.weight_sync import MANIFEST_KEY


@pytest.mark.integration
def test_every_step_record_on_the_broker_carries_the_trainers_signature(stack_settings):
    exporter = StepExporter(Producer(producer_config(stack_settings)), signed.STEP_SIGNER)
    for step in (1, 2):
        exporter(trainer_pb2.TrainerStep(step_id=f"warm:{step}", lineage="warm", step=step), step)
    exporter.flush()
    assert exporter.failed == 0

    written = read_all(stack_settings, (topics.TRAINER_STEPS,))[topics.TRAINER_STEPS]
    assert len(written) == 2
    for message in written:
        problem = signed.SINK_AUTHENTICATOR.problem(
            topics.TRAINER_STEPS, message.value(), record_headers(message)
        )
        assert problem is None


def test_a_step_is_never_signed_for_another_purpose():
    producer = Producer({"bootstrap.servers": "127.0.0.1:1"})
    with pytest.raises(ValueError, match="its own purpose"):
        StepExporter(producer, signing.Signer(MANIFEST_KEY, signing.Purpose.MANIFEST))
