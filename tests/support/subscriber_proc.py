"""An inference worker's weight subscription as a separate process, for tests that kill it.

    PYTHONPATH=tests:. python -m support.subscriber_proc ADDR ARM WORKER_ID OUT_FILE

(``command`` builds that line.) Run as a module, never by path: a script's own directory
comes first on sys.path, and support/ holds modules named like the services
(support/weight_sync.py would shadow the weight_sync package).

Follows ARM on the weight_sync server (or proxy) at ADDR with the subscribe token of
the environment (RTRL_WEIGHT_SYNC_SUBSCRIBE_TOKEN, else the default) and, for every
version yielded, appends ``<version> <weights_checksum>`` to OUT_FILE. Each line is
one write(2) to a file opened O_APPEND, so a SIGKILL leaves whole lines only: a line
is a claim about what the worker would have applied, and a test checks every one.
SIGTERM ends it cleanly.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

import torch
import xxhash

TESTS = Path(__file__).resolve().parents[1]


def command(
    addr: str, arm: str, worker_id: str, out_path: Path
) -> tuple[list[str], dict[str, str]]:
    """The argv that starts this module as a process, and the environment to add to ours."""
    argv = [sys.executable, "-m", "support.subscriber_proc", addr, arm, worker_id, str(out_path)]
    return argv, {"PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)])}


def weights_checksum(weights: Mapping[str, torch.Tensor]) -> str:
    """xxh3_128 over every tensor's name and bytes, in name order."""
    digest = xxhash.xxh3_128()
    for name in sorted(weights):
        digest.update(name.encode())
        digest.update(
            weights[name].detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        )
    return digest.hexdigest()


def main() -> None:
    from rtrl import signing
    from rtrl.config import StackSettings
    from rtrl.weight_sync.client import Subscriber

    addr, arm, worker_id, out_path = sys.argv[1:]
    token = StackSettings().weight_sync_subscribe_token.get_secret_value()
    subscriber = Subscriber(
        addr,
        arm,
        worker_id,
        token=token,
        max_backoff_s=0.5,
        public_keys=signing.parse_public_keys(os.environ["RTRL_MANIFEST_PUBLIC_KEYS"]),
    )
    signal.signal(signal.SIGTERM, lambda *_: subscriber.stop())
    out = os.open(out_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        for manifest, weights in subscriber.follow():
            os.write(out, f"{manifest.version} {weights_checksum(weights)}\n".encode())
    finally:
        os.close(out)
        subscriber.close()


if __name__ == "__main__":
    main()
