"""Tests of bench/: each benchmark on a tiny run. Nothing here asserts wall-clock time.

No fixture is used by this directory's tests alone: the shared ones are in
tests/conftest.py, and a fixture one module needs stays in that module."""
