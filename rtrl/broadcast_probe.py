"""A subscriber for `rtrl bench broadcast`: follows one arm and appends a JSON line per
version it receives whole and checksum-verified (``{"version", "delivered", "bytes"}``,
``delivered`` in time.time() seconds). It does not decode: decoding is each worker's own
CPU work and is measured by `rtrl bench codec`, while eight decoders on this 2-core
machine would only measure the machine.

    python -m rtrl.broadcast_probe ADDR ARM OUT_FILE
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from rtrl.config import StackSettings
from weight_sync.stream import AsyncVersionStream


async def probe(addr: str, arm: str, out: str) -> None:
    token = StackSettings().weight_sync_subscribe_token.get_secret_value()
    stream = AsyncVersionStream(addr, arm, f"probe-{out}", token)
    with open(out, "a") as sink:  # noqa: ASYNC230 - one short line per version; nothing else runs here
        async for manifest, blob in stream.follow():
            delivered = time.time()
            stream.accept(manifest.version)
            sink.write(json.dumps({"version": manifest.version, "delivered": delivered, "bytes": len(blob)}) + "\n")
            sink.flush()


def main() -> None:
    asyncio.run(probe(*sys.argv[1:4]))


if __name__ == "__main__":
    main()
