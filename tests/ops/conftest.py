"""Tests of the operator's shell (ops/): the CLI, `rtrl up`'s state directory, `rtrl
status`, the stack's secrets, the generated docs, and compose/ checked as configuration.

No fixture is used by this directory's tests alone: the shared ones are in
tests/conftest.py, and a fixture one module needs stays in that module."""
