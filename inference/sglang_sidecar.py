"""The SGLang backend's weight sidecar: weight_sync versions pushed into a running server.

Runs next to one SGLang server (``python -m rtrl.inference.sglang_sidecar``). It follows an
arm's versions exactly as the embedded worker does (inference/weights.py: the
Subscriber rebuilds every version's full tensors from keyframes and deltas) and swaps
each one into SGLang mid-generation over SGLang 0.5.23's HTTP weight protocol:

    /pause_generation → /begin_weight_update → /update_weights_from_tensor
        → /end_weight_update → /continue_generation

The pause is what makes the swap land between two decode steps: without it SGLang
waits for every running request to finish first. ``in_place`` keeps the running
requests' KV cache (computed by the old weights, like the embedded engine's "keep");
``retract`` sends them back to the queue to be re-prefilled under the new weights
(like "recompute") and flushes the cache. Every token's version comes back in the
response's ``meta_info.weight_versions`` (see inference/sglang_adapter.py).

Versions carry the checkpoint's Hugging Face names (``q_proj``, ``gate_proj``, a Qwen3's
``q_norm``...): SGLang's weight loader maps them onto its own fused parameters
(``qkv_proj``, ``gate_up_proj``) as it does when loading from disk.

Versions are checked against what the server loaded before anything is paused
(inference/sglang_inventory.py says what SGLang would otherwise do with a tensor that
does not fit); one that does not fit is rejected and never sent. The HTTP steps
themselves are inference/sglang_weight_protocol.py.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from opentelemetry import trace
from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from rtrl import entrypoint, otel, signing
from rtrl.config import RequiredSecret, Settings, StackSettings
from rtrl.inference.sglang_inventory import ServedTensor, as_served, check_fits, inventory_of
from rtrl.inference.sglang_weight_protocol import (
    PauseMode,
    SGLangRefused,
    SGLangWeights,
    serialize_named_tensors,
)
from rtrl.inference.weights import WeightFollower

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("rtrl.sglang_sidecar")


class SidecarSettings(Settings):
    """Settings of one sidecar (env prefix ``RTRL_SGLANG_SIDECAR_``); weight_sync's
    address and subscribe token come from rtrl.config.StackSettings."""

    model_config = SettingsConfigDict(env_prefix="RTRL_SGLANG_SIDECAR_")

    url: str = "http://127.0.0.1:30000"
    """Base URL of the SGLang server this sidecar feeds."""

    api_key: SecretStr = SecretStr("")
    """SGLang's ``--api-key`` (to read the version it serves)."""

    admin_api_key: SecretStr = SecretStr("")
    """SGLang's ``--admin-api-key``: with it set, the weight-update endpoints take only it
    (not the serving ``--api-key``), so only the sidecar can swap the server's weights."""

    model_dir: Path
    """The checkpoint directory the server was launched from (any Hugging Face causal LM
    SGLang serves): its config.json and safetensors headers are the names, shapes and
    dtypes every version must match."""

    arm: Literal["control", "treatment"] = "treatment"
    """The arm whose versions this server serves."""

    pause_mode: PauseMode = "in_place"
    """``in_place``: running requests keep their KV cache across the swap;
    ``retract``: they are re-prefilled under the new weights."""

    max_attempts: int = Field(3, ge=1, le=20)
    """Tries per version when SGLang refuses a step, before the refusal is reported."""

    backoff_s: float = Field(0.5, gt=0, le=30)
    """Wait after the first refused try; doubled after each further one."""

    retry_s: float = Field(5.0, gt=0, le=600)
    """After a reported refusal, how long until the same (or a newer) version is tried again."""

    http_timeout_s: float = Field(120.0, gt=0, le=3600)
    """Timeout of one HTTP call to SGLang (the tensor upload is the longest)."""

    def required_secrets(self, stack: StackSettings) -> list[RequiredSecret]:
        """What the sidecar does not start without."""
        return [
            RequiredSecret(
                stack,
                "weight_sync_subscribe_token",
                "the sidecar follows weight_sync's versions with it",
            ),
            RequiredSecret(
                stack,
                "manifest_public_keys",
                "the sidecar swaps in only versions the trainer signed",
            ),
        ]


class WeightUpdateRefused(RuntimeError):
    """Every attempt to swap a version in was refused. Generation was resumed after each
    attempt and the version is still pending: the next apply tries it again."""

    def __init__(self, version: int, attempts: int, last: SGLangRefused) -> None:
        super().__init__(f"v{version} not applied after {attempts} attempts; last: {last}")
        self.version, self.attempts, self.last = version, attempts, last


class SGLangSidecar:
    """Holds the newest version not yet live on the server and swaps it in.

    ``stage`` (from the follower thread, or a test) keeps one pending version — a newer
    one replaces an older one still pending, since every version carries full tensors.
    ``apply_pending`` swaps it in; a refused version stays pending until it applies or a
    newer one replaces it, and generation is resumed after every attempt."""

    def __init__(
        self,
        weights: SGLangWeights,
        inventory: Mapping[str, ServedTensor],
        settings: SidecarSettings,
    ) -> None:
        self.weights = weights
        self.inventory = dict(inventory)
        self.settings = settings
        self.applied_version = _policy_version(weights.weight_version())
        self._cond = threading.Condition()
        self._apply_lock = threading.Lock()
        self._pending: tuple[int, Mapping[str, Any]] | None = None
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._follower: WeightFollower | None = None
        self.swaps = 0
        self.swap_pause_s = 0.0
        """Time the server stood paused for swaps (pause to continue, every attempt)."""

    @property
    def pending_version(self) -> int | None:
        with self._cond:
            return None if self._pending is None else self._pending[0]

    def stage(self, version: int, tensors: Mapping[str, Any]) -> bool:
        """Make ``version`` the next to apply. False (ignored) if the server already
        has, or is about to get, this version or a newer one; WeightsRejected if it
        does not fit the served model."""
        check_fits(version, tensors, self.inventory)
        with self._cond:
            newest = max(self.applied_version, -1 if self._pending is None else self._pending[0])
            if version <= newest:
                log.info("ignoring v%d: already at v%d", version, newest)
                return False
            self._pending = (version, tensors)
            self._cond.notify_all()
        return True

    def apply_pending(self) -> int | None:
        """Swap the pending version in; return it (None if nothing was pending).
        Raises WeightUpdateRefused once ``max_attempts`` tries were refused."""
        with self._apply_lock:
            with self._cond:
                pending = self._pending
            if pending is None:
                return None
            version, tensors = pending
            staged = self._follower.staged(version) if self._follower is not None else None
            traceparent, staged_ns = staged or ("", time.time_ns())
            attributes = {
                "rtrl.arm": self.settings.arm,
                "rtrl.policy.version": version,
                "rtrl.sglang.url": self.weights.url,
            }
            # The apply span of the embedded worker's kind, a child of the version's weight_sync commit.
            with _tracer.start_as_current_span(
                "weights apply",
                context=otel.parent(traceparent),
                attributes=attributes,
                start_time=staged_ns,
            ):
                serialized = serialize_named_tensors(as_served(tensors, self.inventory))
                attempts = self.settings.max_attempts
                for attempt in range(1, attempts + 1):
                    try:
                        self._swap(version, serialized)
                        break
                    except SGLangRefused as exc:
                        log.warning(
                            "v%d: attempt %d/%d refused: %s", version, attempt, attempts, exc
                        )
                        if attempt == attempts:
                            raise WeightUpdateRefused(version, attempts, exc) from exc
                        time.sleep(self.settings.backoff_s * 2 ** (attempt - 1))
            with self._cond:
                self.applied_version = version
                if self._pending is pending:
                    self._pending = None
            log.info(
                "v%d live on %s (pause mode %s)",
                version,
                self.weights.url,
                self.settings.pause_mode,
            )
            return version

    def _swap(self, version: int, serialized: str) -> None:
        """One attempt. The server is resumed whatever happens once it was paused, and a
        session this attempt opened is closed before that."""
        mode = self.settings.pause_mode
        self.weights.pause(mode)
        paused = time.perf_counter()
        try:
            self.weights.begin()
            try:
                # Retracted requests no longer hold KV, so the cache the old weights
                # filled can be flushed; paused in place they still use it.
                self.weights.update(
                    serialized, weight_version=str(version), flush_cache=mode == "retract"
                )
            finally:
                self.weights.end()
        finally:
            self.weights.continue_generation()
            self.swap_pause_s += time.perf_counter() - paused
        self.swaps += 1

    def recover(self) -> None:
        """Undo what a sidecar that died mid-swap left behind: an open weight-update
        session (which would refuse every later begin) and a paused server."""
        try:
            self.weights.end()
        except SGLangRefused as exc:
            log.debug("no weight-update session to close: %s", exc.message)
        self.weights.continue_generation()

    # ---- the running service: one thread follows weight_sync, one applies ----

    def start(
        self,
        addr: str,
        token: str,
        worker_id: str,
        public_keys: Sequence[str],
        tls_ca_file: Path | None = None,
    ) -> SGLangSidecar:
        """Follow the arm's versions from weight_sync (inference.weights.WeightFollower,
        as the embedded worker does) and swap each into the server from a thread of its own."""
        self.recover()
        self._follower = WeightFollower(
            self.stage,
            addr,
            token,
            self.settings.arm,
            worker_id,
            self.settings.retry_s,
            public_keys=public_keys,
            tls_ca_file=tls_ca_file,
        ).start()
        self._thread = threading.Thread(target=self._apply_loop, name="sglang-apply", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopped.set()
        if self._follower is not None:
            self._follower.stop(timeout_s)
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _apply_loop(self) -> None:
        while not self._stopped.is_set():
            with self._cond:
                while self._pending is None and not self._stopped.is_set():
                    self._cond.wait()
            if self._stopped.is_set():
                return
            try:
                self.apply_pending()
            except Exception:  # retried on purpose: the version stays pending
                log.exception(
                    "swapping v%s into %s failed; trying again in %.1f s",
                    self.pending_version,
                    self.weights.url,
                    self.settings.retry_s,
                )
                self._stopped.wait(self.settings.retry_s)


def _observe(sidecar: SGLangSidecar) -> None:
    """The sidecar's swaps as OpenTelemetry (and so Prometheus) metrics."""
    from opentelemetry import metrics

    meter = metrics.get_meter("rtrl.sglang_sidecar")
    arm = {"arm": sidecar.settings.arm}
    otel.observe(
        meter,
        "rtrl.sglang_sidecar.swaps",
        "counter",
        lambda: [(sidecar.swaps, arm)],
        unit="{swap}",
        description="Versions swapped into SGLang",
    )
    otel.observe(
        meter,
        "rtrl.sglang_sidecar.swap.pause",
        "counter",
        lambda: [(sidecar.swap_pause_s, arm)],
        unit="s",
        description="Time SGLang stood paused for weight swaps",
    )
    otel.observe(
        meter,
        "rtrl.sglang_sidecar.policy.version",
        "gauge",
        lambda: [(sidecar.applied_version, arm)],
        description="Policy version SGLang serves",
    )


def _policy_version(label: str) -> int:
    try:
        return int(label)
    except ValueError:
        raise ValueError(
            f"SGLang serves weight version {label!r}, not an rtrl policy version: launch it with --weight-version <n>"
        ) from None


def main() -> None:
    # Configuration first: a bad setting fails before torch is imported.
    settings, stack = entrypoint.parse_settings(
        "python -m rtrl.inference.sglang_sidecar",
        __doc__,
        SidecarSettings,
        StackSettings,
        required=SidecarSettings.required_secrets,
    )
    entrypoint.configure_logging()
    otel.configure("sglang_sidecar", stack)
    weights = SGLangWeights(
        settings.url,
        settings.http_timeout_s,
        settings.api_key.get_secret_value(),
        settings.admin_api_key.get_secret_value(),
    )
    sidecar = SGLangSidecar(weights, inventory_of(weights, settings.model_dir), settings)
    _observe(sidecar)
    sidecar.start(
        stack.weight_sync_addr,
        stack.weight_sync_subscribe_token.get_secret_value(),
        f"sglang-sidecar-{stack.instance}",
        signing.parse_public_keys(stack.manifest_public_keys),
        stack.weight_sync_tls_ca_file,
    )
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    sidecar.stop()


if __name__ == "__main__":
    main()
