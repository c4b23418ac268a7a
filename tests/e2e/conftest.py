"""Tests that cross every service: the whole stack as `rtrl up` starts it (the loop, a
restart, reward hacking caught live), and hostile event times sent through every place
one enters.

No fixture is used by this directory's tests alone: the shared ones are in
tests/conftest.py, and a fixture one module needs stays in that module."""
