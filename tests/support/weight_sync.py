"""Shared by the weight_sync tests: an in-process server, a following subscriber, and
versions to publish. Fixtures built on these are in tests/conftest.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import faulthandler
import os
import queue
import threading
from typing import ClassVar

import torch

from rtrl import signing
from rtrl.config import StackSettings
from rtrl.kernels.delta import bits_dtype
from rtrl.v1 import weights_pb2
from rtrl.weight_sync.client import Publisher, Subscriber
from rtrl.weight_sync.config import WeightSyncSettings
from rtrl.weight_sync.server import WeightSyncServer

ARM = "treatment"
SUBSCRIBE_TOKEN = StackSettings().weight_sync_subscribe_token.get_secret_value()
# The trainer's manifest key pair (tests/conftest.py generates it): test publishers sign, test workers verify.
MANIFEST_KEY = os.environ["RTRL_TRAINER_MANIFEST_SIGNING_KEY"]
MANIFEST_PUBLIC_KEYS = signing.parse_public_keys(os.environ["RTRL_MANIFEST_PUBLIC_KEYS"])


class InProcessServer:
    """WeightSyncServer on its own event loop thread, so the test thread can use the sync clients."""

    live: ClassVar[set[InProcessServer]] = set()
    """Handles not yet closed: tests/conftest.py closes any a test leaves behind."""

    def __init__(self, settings: WeightSyncSettings, stack: StackSettings) -> None:
        InProcessServer.live.add(self)
        self.settings, self.stack = settings, stack
        self.addr = f"127.0.0.1:{settings.port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.server: WeightSyncServer | None = None

    def _run(self, coro, timeout_s: float = 60.0):
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            # Say where the loop is stuck, and stop the step rather than let it finish unseen.
            faulthandler.dump_traceback(all_threads=True)
            future.cancel()
            raise TimeoutError(
                f"the server's event loop did not finish in {timeout_s:.0f} s"
            ) from None

    @property
    def running(self) -> WeightSyncServer:
        """The server, which the test must have started."""
        assert self.server is not None, "the server is not running"
        return self.server

    def start(self) -> None:
        """Start the server; one that fails or times out is stopped and its loop closed,
        so it cannot go on beating into a Redis the next test uses."""

        async def start():
            self.server = WeightSyncServer(self.settings, self.stack)
            await self.server.start()

        try:
            self._run(start())
        except BaseException:
            self.close()
            raise

    def stop(self) -> None:
        if self.server is not None:
            server, self.server = self.server, None
            self._run(server.stop(grace_s=0))

    def close(self) -> None:
        InProcessServer.live.discard(self)
        try:
            self.stop()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


class Following:
    """Runs Subscriber.follow in a thread, as an inference worker does."""

    def __init__(self, subscriber: Subscriber, have_version: int = -1, weights=None) -> None:
        self.subscriber = subscriber
        self._items: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, args=(have_version, weights), daemon=True)
        self._thread.start()

    def _run(self, have_version, weights) -> None:
        try:
            for item in self.subscriber.follow(have_version, weights):
                self._items.put(item)
        except BaseException as exc:
            self._items.put(exc)

    def next(self, timeout_s: float = 30.0) -> tuple[weights_pb2.Manifest, dict[str, torch.Tensor]]:
        item = self._items.get(timeout=timeout_s)
        if isinstance(item, BaseException):
            raise item
        return item

    def until(self, version: int) -> list[tuple[weights_pb2.Manifest, dict[str, torch.Tensor]]]:
        items = [self.next()]
        while items[-1][0].version < version:
            items.append(self.next())
        return items

    def nothing_pending(self) -> bool:
        return self._items.empty()

    def stop(self) -> None:
        self.subscriber.close()
        self._thread.join(timeout=10)
        assert not self._thread.is_alive()


def assert_bit_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        bits = bits_dtype(tensor.dtype)
        assert torch.equal(got[name].reshape(-1).view(bits), tensor.reshape(-1).view(bits)), name


def train_step(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """New weights with a few elements of a few tensors changed, like a small optimizer step."""
    generator = torch.Generator().manual_seed(seed)
    out = {name: tensor.clone() for name, tensor in weights.items()}
    names = sorted(out)
    for index in torch.randint(len(names), (3,), generator=generator).tolist():
        flat = out[names[index]].view(-1)
        positions = torch.randint(flat.numel(), (5,), generator=generator)
        flat[positions] += torch.randn(5, generator=generator) * 1e-3
    return out


def publish_versions(
    publisher: Publisher, first: dict[str, torch.Tensor], count: int
) -> list[dict[str, torch.Tensor]]:
    versions = [first]
    for seed in range(1, count):
        versions.append(train_step(versions[-1], seed))
    for expected, weights in enumerate(versions):
        assert (
            publisher.publish(
                weights, trained_through_event_ts_ms=1000 + expected, train_step=expected
            )
            == len(versions) - count + expected
        )
    return versions
