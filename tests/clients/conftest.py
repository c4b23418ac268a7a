"""Fixtures of the client SDK tests: the real gateway, started through scripts/ingest_rig.py.

The Python SDK's tests here (test_python_sdk.py, test_conformance.py, test_client_package.py)
also run under Python 3.10-3.13 in virtualenvs that hold rtrl-client and no rtrl
(test_client_pythons.py), so nothing they load imports the server: the rig runs on the
server's interpreter and is reached over HTTP."""

import pytest

from support.ingest_rig import IngestRig


@pytest.fixture
def gateway():
    rig = IngestRig()
    yield rig
    rig.stop()


@pytest.fixture
def api_key(gateway: IngestRig) -> str:
    return gateway.api_key
