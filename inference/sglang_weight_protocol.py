"""SGLang 0.5.23's weight-update HTTP protocol, one call per step, and the tensor
encoding its ``/update_weights_from_tensor`` takes.

Kept apart from the sidecar (inference/sglang_sidecar.py), which decides when to swap
and retries, because the serving adapter (inference/sglang_adapter.py) also reads the
version a server serves through it, and should not pull in the sidecar's settings and
weight_sync follower to do so. The steps of one swap, in order:

    /pause_generation → /begin_weight_update → /update_weights_from_tensor
        → /end_weight_update → /continue_generation
"""

from __future__ import annotations

import base64
import json
import pickle
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any, Literal

PauseMode = Literal["in_place", "retract"]
"""``in_place``: running requests keep their KV cache across the swap; ``retract``: they
are sent back to the queue and re-prefilled under the new weights."""


class SGLangRefused(RuntimeError):
    """SGLang answered a step of the weight protocol with an HTTP error or success=false."""

    def __init__(self, step: str, status: int, message: str) -> None:
        super().__init__(f"SGLang refused {step} (HTTP {status}): {message}")
        self.step, self.status, self.message = step, status, message


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
