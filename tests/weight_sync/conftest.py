"""Tests of weight_sync: the codec, the blob stores, the registry and its recovery, signed
manifests, relays, garbage collection and faults. The in-process server and its
publisher are fixtures of tests/conftest.py (other directories use them too); the
clients' helpers are in support/weight_sync.py.

No fixture is used by this directory's tests alone: the shared ones are in
tests/conftest.py, and a fixture one module needs stays in that module."""
