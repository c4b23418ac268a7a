"""The client's one version: the distribution's (clients/python/pyproject.toml reads it from
here) and the one named on the wire.

Every request to the gateway carries ``X-Rtrl-Sdk: rtrl-client-python/<version>``, the
header the gateway counts events by (its ``rtrl_ingest_sdk_events_total``), and a
``User-Agent`` that also names the interpreter and aiohttp, for people reading logs.
"""

__version__ = "0.2.0"

SDK_NAME = "rtrl-client-python"
SDK_HEADER = "X-Rtrl-Sdk"
"""The header naming the SDK and its version; the TypeScript SDK sends the same one (a
browser's fetch may not set User-Agent)."""
SDK = f"{SDK_NAME}/{__version__}"
