"""Kafka clients carry the process's credentials (issue 17: rtrl/kafka.py could not even be
configured for SASL/TLS).

What can be checked here: every librdkafka client is built on kafka.client_config, real
librdkafka accepts the SASL_SSL configuration it produces (it validates properties when a
client is created), faust gets the same credentials, and SASL without credentials is
refused at start. What cannot: a SASL handshake, since the embedded broker (Tansu) has no
authentication and no Kafka broker runs here; compose/ runs Apache Kafka with SASL/SCRAM.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient
from pydantic import ValidationError

from rtrl import kafka
from rtrl.config import StackSettings

REPO = Path(__file__).resolve().parents[2]
SECURE: dict[str, Any] = {
    "kafka_bootstrap": "127.0.0.1:1", "kafka_security_protocol": "SASL_SSL", "kafka_sasl_mechanism": "SCRAM-SHA-512",
    "kafka_sasl_username": "trainer", "kafka_sasl_password": "s3cret",
}  # fmt: skip


def test_every_client_config_carries_the_credentials_and_librdkafka_takes_them():
    settings = StackSettings(**SECURE)
    configs = {
        "producer": kafka.producer_config(settings),
        "consumer": kafka.consumer_config(settings, "g"),
        "client": kafka.client_config(settings, **{"group.id": "probe"}),
    }
    for name, config in configs.items():
        assert (
            config["security.protocol"],
            config["sasl.mechanism"],
            config["sasl.username"],
            config["sasl.password"],
        ) == (
            "sasl_ssl",
            "SCRAM-SHA-512",
            "trainer",
            "s3cret",
        ), name
    # librdkafka refuses unknown properties or values when a client is created.
    Producer(configs["producer"]).flush(0)
    Consumer(configs["consumer"]).close()
    AdminClient(configs["client"])
    with pytest.raises(Exception, match="Unsupported SASL mechanism"):
        Producer({**configs["producer"], "sasl.mechanism": "NOT-A-MECHANISM"})
    plain = kafka.producer_config(StackSettings(kafka_bootstrap="127.0.0.1:1"))
    assert plain["security.protocol"] == "plaintext" and not any(
        k.startswith("sasl.") for k in plain
    )


def test_faust_gets_the_same_credentials():
    credentials = kafka.faust_credentials(StackSettings(**SECURE))
    assert (credentials.username, credentials.password, credentials.mechanism.value) == (
        "trainer",
        "s3cret",
        "SCRAM-SHA-512",
    )
    assert credentials.ssl_context is not None
    assert kafka.faust_credentials(StackSettings()) is None


def test_sasl_without_credentials_is_refused_at_start():
    with pytest.raises(ValidationError, match="needs kafka_sasl_username and kafka_sasl_password"):
        StackSettings(kafka_security_protocol="SASL_SSL", kafka_sasl_username="trainer")


def test_no_client_is_configured_outside_rtrl_kafka():
    """A config dict naming bootstrap.servers anywhere else would connect without credentials."""
    offenders = []
    for path in sorted(REPO.glob("*/**/*.py")):
        if (
            ".venv" in path.parts
            or path.relative_to(REPO).parts[0] == "tests"
            or path == REPO / "rtrl" / "kafka.py"
        ):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value == "bootstrap.servers":
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert offenders == []
