"""Tests of the analytics sink, the A/B report and its views, the /query guard, and the
report's HTML. Hand-made records are in support/analytics.py.

No fixture is used by this directory's tests alone: the shared ones are in
tests/conftest.py, and a fixture one module needs stays in that module."""
