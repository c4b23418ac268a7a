"""Subscribers for `rtrl bench broadcast`: one stream per address given, each on its own
connection, following one arm. For every version a stream receives whole and
checksum-verified it appends a JSON line ``{"version", "delivered", "bytes"}``
(``delivered`` in time.time() seconds) to ``<out_prefix>-<i>.jsonl``.

They do not decode: decoding is each worker's own CPU work, measured by
`rtrl bench codec`.

    python -m rtrl.ops.broadcast_probe OUT_PREFIX ARM ADDR [ADDR ...]
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from rtrl.config import StackSettings
from rtrl.weight_sync.stream import AsyncVersionStream


async def follow(stream: AsyncVersionStream, out: str) -> None:
    with open(out, "a") as sink:
        async for manifest, blob in stream.follow():
            delivered = time.time()
            stream.accept(manifest.version)
            sink.write(
                json.dumps(
                    {"version": manifest.version, "delivered": delivered, "bytes": len(blob)}
                )
                + "\n"
            )
            sink.flush()


async def probe(out_prefix: str, arm: str, addrs: list[str]) -> None:
    token = StackSettings().weight_sync_subscribe_token.get_secret_value()
    # A private subchannel pool per stream: without it, gRPC would share one connection among them.
    streams = [
        AsyncVersionStream(
            addr, arm, f"probe-{i}", token, channel_options=(("grpc.use_local_subchannel_pool", 1),)
        )
        for i, addr in enumerate(addrs)
    ]
    await asyncio.gather(
        *(follow(stream, f"{out_prefix}-{i}.jsonl") for i, stream in enumerate(streams))
    )


def main() -> None:
    out_prefix, arm, *addrs = sys.argv[1:]
    asyncio.run(probe(out_prefix, arm, addrs))


if __name__ == "__main__":
    main()
