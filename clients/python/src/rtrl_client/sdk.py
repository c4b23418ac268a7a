"""The SDK for product code: typed event helpers and ``Telemetry``, a durable batching client.

Product code reports an event and moves on; the event must still reach the gateway if
the gateway is down, the network drops or the product process is killed. So
``Telemetry`` appends every event to an on-disk ``Spool`` (fsynced) before the call
returns, and a background thread (sender.py) sends what the spool holds, oldest
first, through ``IngestClient``'s retries. An event leaves the spool only once the gateway gave a final
answer: ACCEPTED, DUPLICATE, or REJECTED (reported, never resent). Anything may thus be
sent twice (after a crash, a cut connection, a lost answer); the gateway deduplicates
by event_id, so the second copy is answered DUPLICATE and written nowhere, even when
the gateway was killed while producing it (the server's ingest/gateway.py and ingest/recovery.py).

    with Telemetry("http://ingest:8081", api_key=key, spool_dir="/var/lib/app/telemetry") as t:
        t.edit_shown(rollout_id=r, session_id=s, user_id=u, file_path="a.py", edit_text=text)

The spool's layout is described in spool.py.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
import urllib.parse
import weakref
from collections.abc import Callable, Sequence
from typing import TypeVar

from rtrl_client.client import IngestError, make_event
from rtrl_client.sender import DeliveryStats, RejectedEvent, Sender, TelemetrySettings
from rtrl_client.spool import Spool, SpoolFull, SpoolLocked  # noqa: F401 - SpoolFull and SpoolLocked are raised to SDK users
from rtrl_client.v1 import telemetry_pb2

log = logging.getLogger("rtrl_client")


# ---- typed helpers: one per payload, keyword arguments named as in telemetry.proto ----


def edit_shown(
    *,
    rollout_id: str,
    session_id: str,
    user_id: str,
    file_path: str,
    edit_text: str,
    privacy_mode: bool = False,
    client_ts_ms: int | None = None,
) -> telemetry_pb2.TelemetryEvent:
    """The product showed the user an edit written by the policy."""
    payload = telemetry_pb2.EditShown(file_path=file_path, edit_text=edit_text)
    return make_event(
        rollout_id,
        session_id,
        user_id,
        edit_shown=payload,
        privacy_mode=privacy_mode,
        client_ts_ms=client_ts_ms,
    )


def edit_outcome(
    *,
    rollout_id: str,
    session_id: str,
    user_id: str,
    outcome: telemetry_pb2.EditOutcome.Outcome | str,
    privacy_mode: bool = False,
    client_ts_ms: int | None = None,
) -> telemetry_pb2.TelemetryEvent:
    """What the user did with the edit right away: ``"accepted"``/``"rejected"`` or an ``EditOutcome.Outcome``."""
    if isinstance(outcome, str):
        # protobuf's stubs type Value() as returning int, not the enum it looks the name up in.
        outcome = telemetry_pb2.EditOutcome.Outcome.Value("OUTCOME_" + outcome.upper())  # type: ignore[assignment]
    payload = telemetry_pb2.EditOutcome(outcome=outcome)
    return make_event(
        rollout_id,
        session_id,
        user_id,
        edit_outcome=payload,
        privacy_mode=privacy_mode,
        client_ts_ms=client_ts_ms,
    )


def persistence_snapshot(
    *,
    rollout_id: str,
    session_id: str,
    user_id: str,
    seconds_after_edit: float,
    region_text: str,
    privacy_mode: bool = False,
    client_ts_ms: int | None = None,
) -> telemetry_pb2.TelemetryEvent:
    """The edited region as it looked ``seconds_after_edit`` after the edit was applied."""
    payload = telemetry_pb2.PersistenceSnapshot(
        seconds_after_edit=seconds_after_edit, region_text=region_text
    )
    return make_event(
        rollout_id,
        session_id,
        user_id,
        persistence=payload,
        privacy_mode=privacy_mode,
        client_ts_ms=client_ts_ms,
    )


def followup(
    *,
    rollout_id: str,
    session_id: str,
    user_id: str,
    seconds_after_edit: float,
    message: str,
    privacy_mode: bool = False,
    client_ts_ms: int | None = None,
) -> telemetry_pb2.TelemetryEvent:
    """A message the user sent after seeing the edit."""
    payload = telemetry_pb2.FollowUp(seconds_after_edit=seconds_after_edit, message=message)
    return make_event(
        rollout_id,
        session_id,
        user_id,
        followup=payload,
        privacy_mode=privacy_mode,
        client_ts_ms=client_ts_ms,
    )


# ---- the client ----


_open_clients: weakref.WeakSet[Telemetry] = weakref.WeakSet()
_T = TypeVar("_T", bound="Telemetry")  # typing.Self is Python 3.11's; the client runs on 3.10


class Telemetry:
    """Report events from any thread; a background thread delivers them. See the module doc.

    The reporting methods take the keyword arguments of the module's helpers of the same
    name and return the event (its event_id is the dedup key). When they return, the event
    is on disk; they raise SpoolFull rather than drop it."""

    def __init__(
        self,
        url: str,
        *,
        spool_dir: str | os.PathLike,
        api_key: str | None = None,
        settings: TelemetrySettings | None = None,
        on_rejected: Callable[[RejectedEvent], None] | None = None,
    ) -> None:
        settings = settings or TelemetrySettings()
        if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
            raise ValueError(f"the gateway URL must be http(s)://host:port, got {url!r}")
        self.settings = settings
        self._closed = False
        self._spool = Spool(
            spool_dir,
            max_bytes=settings.max_spool_bytes,
            segment_bytes=settings.segment_bytes,
            fsync=settings.fsync,
        )
        self._sender = Sender(
            self._spool, url, api_key=api_key, settings=settings, on_rejected=on_rejected
        )
        self.stats: DeliveryStats = self._sender.stats
        self.rejected = self._sender.rejected
        """The most recent REJECTED events (settings.max_rejected_kept of them)."""
        _open_clients.add(self)

    # -- reporting: durable when the call returns --

    def edit_shown(
        self,
        *,
        rollout_id: str,
        session_id: str,
        user_id: str,
        file_path: str,
        edit_text: str,
        privacy_mode: bool = False,
        client_ts_ms: int | None = None,
    ) -> telemetry_pb2.TelemetryEvent:
        return self._report(
            edit_shown(
                rollout_id=rollout_id,
                session_id=session_id,
                user_id=user_id,
                file_path=file_path,
                edit_text=edit_text,
                privacy_mode=privacy_mode,
                client_ts_ms=client_ts_ms,
            )
        )

    def edit_outcome(
        self,
        *,
        rollout_id: str,
        session_id: str,
        user_id: str,
        outcome: telemetry_pb2.EditOutcome.Outcome | str,
        privacy_mode: bool = False,
        client_ts_ms: int | None = None,
    ) -> telemetry_pb2.TelemetryEvent:
        return self._report(
            edit_outcome(
                rollout_id=rollout_id,
                session_id=session_id,
                user_id=user_id,
                outcome=outcome,
                privacy_mode=privacy_mode,
                client_ts_ms=client_ts_ms,
            )
        )

    def persistence_snapshot(
        self,
        *,
        rollout_id: str,
        session_id: str,
        user_id: str,
        seconds_after_edit: float,
        region_text: str,
        privacy_mode: bool = False,
        client_ts_ms: int | None = None,
    ) -> telemetry_pb2.TelemetryEvent:
        return self._report(
            persistence_snapshot(
                rollout_id=rollout_id,
                session_id=session_id,
                user_id=user_id,
                seconds_after_edit=seconds_after_edit,
                region_text=region_text,
                privacy_mode=privacy_mode,
                client_ts_ms=client_ts_ms,
            )
        )

    def followup(
        self,
        *,
        rollout_id: str,
        session_id: str,
        user_id: str,
        seconds_after_edit: float,
        message: str,
        privacy_mode: bool = False,
        client_ts_ms: int | None = None,
    ) -> telemetry_pb2.TelemetryEvent:
        return self._report(
            followup(
                rollout_id=rollout_id,
                session_id=session_id,
                user_id=user_id,
                seconds_after_edit=seconds_after_edit,
                message=message,
                privacy_mode=privacy_mode,
                client_ts_ms=client_ts_ms,
            )
        )

    def send(self, events: Sequence[telemetry_pb2.TelemetryEvent]) -> None:
        """Report ready-made events with one spool write (and one fsync): on disk when this
        returns, or SpoolFull and none of them is."""
        if self._closed:
            raise RuntimeError("Telemetry is closed")
        self._spool.append([event.SerializeToString() for event in events])
        self._sender.wake()

    def _report(self, event: telemetry_pb2.TelemetryEvent) -> telemetry_pb2.TelemetryEvent:
        self.send([event])
        return event

    # -- delivery --

    @property
    def pending(self) -> int:
        """Events spooled and not answered yet."""
        return len(self._spool)

    @property
    def spool_bytes(self) -> int:
        """Disk the spool uses, counted against settings.max_spool_bytes."""
        return self._spool.bytes

    @property
    def oldest_pending_age_s(self) -> float:
        """How long the oldest unanswered event has waited in the spool (0 when none)."""
        spooled_at = self._spool.oldest_spooled_at()
        return 0.0 if spooled_at is None else max(0.0, time.monotonic() - spooled_at)

    @property
    def spool_dir(self) -> str:
        return str(self._spool.directory)

    @property
    def last_error(self) -> BaseException | None:
        """Why the latest round delivered nothing; None after a round with answers."""
        return self._sender.last_error

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every event reported before this call is answered; False on timeout.

        Raises the gateway's IngestError (e.g. IngestAuthError for a refused key) when
        waiting longer cannot help; the events stay spooled either way."""
        return self._sender.wait_answered(self._spool.last_seq, timeout_s)

    def close(self, timeout_s: float | None = None) -> bool:
        """Flush for up to timeout_s (settings.close_timeout_s by default), stop the sender
        and release the spool. True if everything was delivered; the rest stays spooled
        and is sent by the next Telemetry on the same spool_dir. A refused key is logged
        here, not raised (last_error has it)."""
        if self._closed:
            return not self.pending
        timeout_s = self.settings.close_timeout_s if timeout_s is None else timeout_s
        try:
            delivered = self.flush(timeout_s)
        except IngestError as exc:
            # Cleanup must finish (and not hide the caller's own exception); flush() raises
            # this, close() says it and leaves the events spooled.
            log.error("telemetry: closing while the gateway refuses the request: %s", exc)
            delivered = False
        finally:
            self._closed = True
            self._stop()
            _open_clients.discard(self)
        if not delivered:
            log.warning(
                "telemetry: %d events not delivered yet; they stay in %s for the next start",
                self.pending,
                self._spool.directory,
            )
        return delivered

    def __enter__(self: _T) -> _T:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _stop(self) -> None:
        if self._sender.stop():
            self._spool.close()
        else:
            log.error(
                "telemetry sender did not stop; leaving spool %s locked until exit",
                self._spool.directory,
            )


@atexit.register
def _flush_open_clients() -> None:
    for telemetry in list(_open_clients):
        try:
            telemetry.close()
        except Exception:  # nobody is left to raise to: say it, the events stay spooled
            log.exception("telemetry: flush at exit failed; undelivered events stay in the spool")
