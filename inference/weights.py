"""Feeding a server from weight_sync: one thread per arm follows the arm's versions
(the embedded engine's worker and the SGLang sidecar both use it)."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rtrl.v1 import weights_pb2
    from rtrl.weight_sync.client import RefusalBackoff, Subscriber

log = logging.getLogger(__name__)


# A worker catching up re-reads the latest version this often while it skips versions.
CATCH_UP_RECHECK_S = 2.0


class WeightFollower:
    """Hands every version of ``arm`` that weight_sync streams to ``stage(version,
    weights)``, which returns whether it took the version (False: already held).

    The Subscriber re-subscribes by itself when weight_sync restarts; if it gives up
    (an error it does not retry), a fresh one starts from scratch after ``retry_s``,
    and ``stage`` ignores versions it already holds. An exception from ``stage`` is
    logged and the stream goes on: one unusable version must not stop the next. Only
    versions whose manifest verifies against ``public_keys`` (the trainer's) arrive.

    A refused version (weight_sync/refusals.py) is logged and counted once (``refused``),
    however long the registry points at it and however many subscribers the follower
    starts: they share what was refused. The worker keeps serving what it staged, and a
    fresh start from a keyframe waits a pause doubling with each refusal
    (``refusal_backoff``), cut short by a new version.

    ``staged(version)`` tells when a version was staged and the traceparent of the
    weight_sync span that committed it: the worker's apply span continues that trace."""

    def __init__(
        self,
        stage: Callable[[int, dict[str, torch.Tensor]], bool],
        addr: str,
        token: str,
        arm: str,
        worker_id: str,
        retry_s: float = 2.0,
        *,
        public_keys: Sequence[str],
        tls_ca_file: Path | None = None,
        refusal_backoff: RefusalBackoff | None = None,
    ) -> None:
        from rtrl.weight_sync.client import Refusals
        from rtrl.weight_sync.provenance import ManifestVerifier

        ManifestVerifier(
            public_keys
        )  # no keys, or a malformed one: refused here, not in the thread
        self.public_keys = tuple(public_keys)
        self.tls_ca_file = tls_ca_file
        self.stage = stage
        self.addr = addr
        self.token = token
        self.arm = arm
        self.worker_id = worker_id
        self.retry_s = retry_s
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._subscriber: Subscriber | None = None
        self._staged: OrderedDict[int, tuple[str, int]] = OrderedDict()
        self._refusals = Refusals(refusal_backoff)
        """What this worker refused, shared by its successive subscribers."""
        self._newest_step = -1
        """The highest train_step taken, carried from one subscriber to the next."""
        self._newest_version = -1
        """The newest version staged (or refused by ``stage``): the next subscriber starts
        from a keyframe but hands over only newer ones (the chain to them is older, and no
        rollback)."""
        self._thread = threading.Thread(target=self._run, name=f"weights-{arm}", daemon=True)

    def start(self) -> WeightFollower:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopped.set()
        with self._lock:
            if self._subscriber is not None:
                self._subscriber.stop()
        self._thread.join(timeout_s)

    @property
    def refused(self) -> int:
        """Versions refused, each once: manifests that are not the trainer's for this arm
        (forged), old versions it did sign replayed as new ones (rolled back), versions
        that cannot be decoded."""
        return self._refusals.total

    def staged(self, version: int) -> tuple[str, int] | None:
        """(traceparent, time.time_ns() when staged) of a version this follower staged."""
        with self._lock:
            return self._staged.get(version)

    def _latest(self) -> int:
        """The arm's latest version as this subscription starts. A worker catching up
        (a restart, a long disconnect) decodes the versions before it but stages only
        it: it never serves the intermediate versions, nor the keyframe a catch-up
        starts from, however long ago that was published."""
        from rtrl.weight_sync.client import latest_version

        try:
            return latest_version(self.addr, self.token, self.arm, tls_ca_file=self.tls_ca_file)
        except Exception:  # weight_sync unreachable: stage every version as it comes
            log.warning(
                "could not read the latest %s version from %s; staging every version",
                self.arm,
                self.addr,
                exc_info=True,
            )
            return -1

    def _remember(self, version: int, traceparent: str) -> None:
        with self._lock:
            self._staged[version] = (traceparent, time.time_ns())
            while len(self._staged) > 64:
                self._staged.popitem(last=False)

    def _stage(self, manifest: weights_pb2.Manifest, weights: dict[str, torch.Tensor]) -> None:
        try:
            if self.stage(manifest.version, weights):
                self._remember(manifest.version, manifest.traceparent)
                log.info("staged %s v%d from %s", self.arm, manifest.version, self.addr)
        except ValueError as exc:
            log.error("%s v%d from %s not staged: %s", self.arm, manifest.version, self.addr, exc)

    def _run(self) -> None:
        # Imported here so the engine and its unit tests do not need the gRPC client.
        from rtrl.weight_sync.client import Subscriber

        while not self._stopped.is_set():
            subscriber = Subscriber(
                self.addr,
                self.arm,
                self.worker_id,
                token=self.token,
                public_keys=self.public_keys,
                tls_ca_file=self.tls_ca_file,
                newest_step=self._newest_step,
                refusals=self._refusals,
            )
            with self._lock:
                self._subscriber = subscriber
            if self._stopped.is_set():
                break
            try:
                catch_up_to, read_at = self._latest(), time.monotonic()
                for manifest, weights in subscriber.follow(self._newest_version):
                    if (
                        manifest.version < catch_up_to
                        and time.monotonic() - read_at > CATCH_UP_RECHECK_S
                    ):
                        # A slow catch-up, or a registry rebuilt below what we were told: ask again.
                        catch_up_to, read_at = self._latest(), time.monotonic()
                    if manifest.version < catch_up_to:
                        continue  # on the way to the version that was latest when we subscribed
                    self._stage(manifest, weights)
                    self._newest_version = manifest.version
            except Exception:  # retried on purpose: the worker must keep following
                log.exception(
                    "following %s weights from %s failed; starting over in %.1f s",
                    self.arm,
                    self.addr,
                    self.retry_s,
                )
            finally:
                subscriber.close()
                with self._lock:
                    self._newest_step = subscriber.newest_step  # a rollback stays refused
                    self._subscriber = None
            self._stopped.wait(self.retry_s)
