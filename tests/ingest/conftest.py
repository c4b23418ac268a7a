"""Fixtures of the ingest tests (the gateway, its SDK, validation and recovery). The
events they send and the topic reader are plain functions in support/ingest.py."""

import gc

import pytest


@pytest.fixture
def collect_kafka_clients(stack_settings):
    yield
    # A closed AsyncProducer keeps its librdkafka handle (and broker connection) until
    # it is collected; the server's objects sit in reference cycles, and Tansu waits
    # ~5 s for open connections when the fixture stops it.
    gc.collect()
