"""A subscriber for `rtrl bench broadcast`: follows one arm and appends a JSON line per
version it receives whole and checksum-verified (``{"version", "delivered", "bytes"}``,
``delivered`` in time.time() seconds). It does not decode: decoding is each worker's own
CPU work and is measured by `rtrl bench codec`, while eight decoders on this 2-core
machine would only measure the machine.

    python -m rtrl.broadcast_probe ADDR ARM OUT_FILE
"""

from __future__ import annotations

import json
import sys
import time

from rtrl.config import StackSettings
from weight_sync.stream import VersionStream


def main() -> None:
    addr, arm, out = sys.argv[1:4]
    token = StackSettings().weight_sync_subscribe_token.get_secret_value()
    stream = VersionStream(addr, arm, f"probe-{out}", token)
    with open(out, "a") as sink:
        for manifest, blob in stream.follow():
            delivered = time.time()
            stream.accept(manifest.version)
            sink.write(json.dumps({"version": manifest.version, "delivered": delivered, "bytes": len(blob)}) + "\n")
            sink.flush()


if __name__ == "__main__":
    main()
