"""Tests of the kernels: the Triton paths against the torch paths, bit for bit (under
TRITON_INTERPRET=1, set in tests/conftest.py, they run on this CPU).

No fixture is used by this directory's tests alone: the shared ones are in
tests/conftest.py, and a fixture one module needs stays in that module."""
