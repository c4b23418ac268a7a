"""The SGLang backend's weight sidecar: weight_sync versions pushed into a running server.

Runs next to one SGLang server (``python -m inference.sglang_sidecar``). It follows an
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

Three things SGLang 0.5.23 does not refuse, so the sidecar checks them itself before it
pauses anything: a tensor whose shape differs from the served parameter kills the
server's scheduler (an AssertionError in its weight loader takes the whole server
down), a tensor with an unknown name is skipped while the server still reports the new
version, and a tensor of another kind of dtype (integers into a float parameter) is
silently converted. A version must therefore match what the server loaded from the
checkpoint (``served_inventory``): the same names and shapes, floating-point tensors
where it serves floating point (sent in the dtype it serves, ``--dtype``); one that does
not is rejected and never sent.
"""

from __future__ import annotations

import base64
import json
import logging
import pickle
import signal
import struct
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from opentelemetry import trace
from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from inference.weights import WeightFollower
from rtrl import entrypoint, otel, signing
from rtrl.config import Settings, StackSettings

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("rtrl.sglang_sidecar")

PauseMode = Literal["in_place", "retract"]


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


class SGLangRefused(RuntimeError):
    """SGLang answered a step of the weight protocol with an HTTP error or success=false."""

    def __init__(self, step: str, status: int, message: str) -> None:
        super().__init__(f"SGLang refused {step} (HTTP {status}): {message}")
        self.step, self.status, self.message = step, status, message


class WeightUpdateRefused(RuntimeError):
    """Every attempt to swap a version in was refused. Generation was resumed after each
    attempt and the version is still pending: the next apply tries it again."""

    def __init__(self, version: int, attempts: int, last: SGLangRefused) -> None:
        super().__init__(f"v{version} not applied after {attempts} attempts; last: {last}")
        self.version, self.attempts, self.last = version, attempts, last


class WeightsRejected(ValueError):
    """A version does not fit the served model; it is never sent to SGLang."""


class SGLangWeights:
    """SGLang 0.5.23's weight-update HTTP protocol, one method per step.

    Each method raises SGLangRefused when the server refuses the step, and lets
    connection errors propagate (the server is not there to refuse anything)."""

    def __init__(
        self, url: str, timeout_s: float = 120.0, api_key: str = "", admin_api_key: str = ""
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        # SGLang takes its --api-key on the serving endpoints (/model_info here) and, when it
        # has one, only its --admin-api-key on the weight steps.
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        admin = admin_api_key or api_key
        self._admin_headers = {"Authorization": f"Bearer {admin}"} if admin else {}

    def pause(self, mode: PauseMode) -> None:
        self._post("pause", "/pause_generation", {"mode": mode})

    def begin(self) -> None:
        self._post("begin", "/begin_weight_update", {})

    def update(self, serialized: str, *, weight_version: str, flush_cache: bool) -> None:
        """Load the tensors of ``serialized`` (see serialize_named_tensors) and label
        the weights ``weight_version``. ``flush_cache`` must be false while requests are
        paused in place (SGLang refuses to flush a cache that running requests use)."""
        body = {
            "serialized_named_tensors": [serialized],
            "flush_cache": flush_cache,
            "weight_version": weight_version,
        }
        self._post("update", "/update_weights_from_tensor", body)

    def end(self) -> None:
        self._post("end", "/end_weight_update", {})

    def continue_generation(self) -> None:
        self._post("continue", "/continue_generation", {})

    def weight_version(self) -> str:
        """The label of the weights the server serves now."""
        return str(self._get("/model_info")["weight_version"])

    def architectures(self) -> list[str]:
        """The model classes of the checkpoint the server loaded (its config's ``architectures``)."""
        return list(self._get("/model_info").get("architectures") or [])

    def dtype(self) -> str:
        """The server's ``--dtype`` (``auto`` unless it was launched with one)."""
        return str(self._get("/server_info")["dtype"])

    def _get(self, path: str) -> dict[str, Any]:
        request = urllib.request.Request(f"{self.url}{path}", headers=self._headers)
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            answer: dict[str, Any] = json.loads(response.read())
        return answer

    def _post(self, step: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            f"{self.url}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **self._admin_headers},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                answer = json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            raise SGLangRefused(step, exc.code, _error_message(exc)) from None
        # /pause_generation and /continue_generation answer {"status": "ok"}, the weight
        # steps {"success": bool, "message": str}.
        if answer.get("success") is False:
            raise SGLangRefused(step, 200, answer.get("message", ""))
        return answer


def _error_message(exc: urllib.error.HTTPError) -> str:
    body = exc.read().decode(errors="replace")
    try:
        return json.loads(body).get("message", body)
    except (ValueError, AttributeError):
        return body


def serialize_named_tensors(tensors: Mapping[str, Any]) -> str:
    """The ``serialized_named_tensors`` entry SGLang's HTTP endpoint takes: a base64
    plain pickle of ``[(name, tensor), ...]``. Plain pickle carries the bytes inside
    (SGLang's safe unpickler accepts torch's storage rebuild); torch's multiprocessing
    pickler would instead pass shared-memory handles only valid on this host."""
    named = [(name, tensor.detach().cpu().contiguous()) for name, tensor in tensors.items()]
    return base64.b64encode(pickle.dumps(named, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")


@dataclass(frozen=True)
class ServedTensor:
    """One tensor as the server holds it, which a version's tensor of that name must match."""

    shape: tuple[int, ...]
    dtype: str
    """torch's name of the dtype the server holds it in (``float32``, ``bfloat16``...)."""


# safetensors' dtype names → torch's.
_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
# What the dense (unquantized) weights of a checkpoint are stored and served in; anything
# else (fp8, packed integers) SGLang loads as stored.
_DENSE_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})
# SGLang's --dtype spellings (sglang/srt/configs/model_config.py).
_SGLANG_DTYPES = {
    "half": "float16",
    "float16": "float16",
    "float": "float32",
    "float32": "float32",
    "bfloat16": "bfloat16",
}
# Tensors SGLang's loaders skip (rotary tables some checkpoints store): never served.
_SKIPPED = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def served_dtype(server_dtype: str, config: Mapping[str, Any]) -> str:
    """The dtype SGLang 0.5.23 holds a checkpoint's dense weights in, for its ``--dtype``
    and the checkpoint's config.json (sglang/srt/configs/model_config.py,
    ``_get_and_verify_dtype``): ``auto`` keeps the config's dtype, except that float32
    checkpoints are served in float16 (bfloat16 for Gemma)."""
    if server_dtype.lower() != "auto":
        return _SGLANG_DTYPES[server_dtype.lower()]
    text = config.get("text_config") or config
    stored = text.get("dtype") or text.get("torch_dtype") or config.get("dtype") or "float32"
    if _SGLANG_DTYPES.get(stored, "float32") != "float32":
        return _SGLANG_DTYPES[stored]
    return "bfloat16" if str(text.get("model_type", "")).startswith("gemma") else "float16"


def served_inventory(model_dir: Path, server_dtype: str = "float32") -> dict[str, ServedTensor]:
    """Name → shape and dtype of every tensor a server launched on ``model_dir`` with
    ``--dtype server_dtype`` holds, read from config.json and the safetensors headers (no
    tensor data is loaded). Left out: what SGLang's loaders skip (rotary tables) and,
    with tied embeddings, ``lm_head.weight`` (the embedding is the head: a version
    changes both through ``model.embed_tokens.weight``)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    dense = served_dtype(server_dtype, config)
    tied = bool(config.get("tie_word_embeddings", False))
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    inventory: dict[str, ServedTensor] = {}
    for path in files:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, meta in header.items():
            if name == "__metadata__" or name.endswith(_SKIPPED):
                continue
            if tied and name == "lm_head.weight":
                continue
            stored = _SAFETENSORS_DTYPES.get(meta["dtype"], meta["dtype"])
            inventory[name] = ServedTensor(
                tuple(meta["shape"]), dense if stored in _DENSE_DTYPES else stored
            )
    return inventory


def inventory_of(weights: SGLangWeights, model_dir: Path) -> dict[str, ServedTensor]:
    """The inventory of the server behind ``weights``, launched on ``model_dir``: refuses
    (ValueError) a server that loaded a model of other architectures, and reads the
    dtype it serves from the server itself."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    expected, served = list(config.get("architectures") or []), weights.architectures()
    if expected and served and expected != served:
        raise ValueError(
            f"{weights.url} serves {served}, but the sidecar's model_dir {model_dir} holds {expected}"
        )
    return served_inventory(model_dir, weights.dtype())


def check_fits(
    version: int, tensors: Mapping[str, Any], inventory: Mapping[str, ServedTensor]
) -> None:
    """Raise WeightsRejected unless ``tensors`` has exactly the served names and shapes,
    and each a dtype the served one can take without changing kind: any floating-point
    dtype for a dense weight (sent converted to the served dtype), the very same dtype
    otherwise. A partial version would leave old tensors under the new version's label."""
    unknown = sorted(set(tensors) - set(inventory))
    missing = sorted(set(inventory) - set(tensors))
    wrong_shape = sorted(
        f"{name} {tuple(t.shape)} (served {inventory[name].shape})"
        for name, t in tensors.items()
        if name in inventory and tuple(t.shape) != inventory[name].shape
    )
    wrong_dtype = sorted(
        f"{name} {_dtype_name(t)} (served {inventory[name].dtype})"
        for name, t in tensors.items()
        if name in inventory and not _convertible(_dtype_name(t), inventory[name].dtype)
    )
    if unknown or missing or wrong_shape or wrong_dtype:
        raise WeightsRejected(
            f"v{version} does not fit the served model: unknown {unknown[:5]}, "
            f"missing {missing[:5]}, wrong shape {wrong_shape[:5]}, wrong dtype {wrong_dtype[:5]}"
        )


def as_served(tensors: Mapping[str, Any], inventory: Mapping[str, ServedTensor]) -> dict[str, Any]:
    """``tensors`` (checked by check_fits) in the dtypes the server holds them in: what it
    would round them to on load, converted here so the upload is no larger than needed."""
    import torch

    return {name: t.to(getattr(torch, inventory[name].dtype)) for name, t in tensors.items()}


def _dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _convertible(dtype: str, served: str) -> bool:
    return dtype == served or (dtype in _DENSE_DTYPES and served in _DENSE_DTYPES)


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
        "python -m inference.sglang_sidecar", __doc__, SidecarSettings, StackSettings
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
