"""Tests of the inference workers: the torch engine (swaps between decode steps), the
serving API, and the SGLang backend.

No fixture is used by this directory's tests alone: the shared ones are in
tests/conftest.py, and a fixture one module needs stays in that module."""
