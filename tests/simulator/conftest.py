"""Tests of the simulated product: the users' hidden judgement and the warm start.

No fixture is used by this directory's tests alone: the shared ones are in
tests/conftest.py, and a fixture one module needs stays in that module."""
