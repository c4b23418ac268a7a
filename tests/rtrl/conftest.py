"""Tests of the foundation (rtrl/): Kafka and its credentials, OpenTelemetry, a service's
process life, TLS on every listener, the import layers, and the test tree itself.

No fixture is used by this directory's tests alone: the shared ones are in
tests/conftest.py, and a fixture one module needs stays in that module."""
