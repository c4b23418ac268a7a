"""rtrl's client for product code: report what users did with the policy's edits.

    from rtrl_client import Telemetry

    with Telemetry("https://ingest.example.com", api_key=key, spool_dir="/var/lib/app/rtrl") as t:
        t.edit_shown(rollout_id=r, session_id=s, user_id=u, file_path="a.py", edit_text=text)

``Telemetry`` (sdk.py) spools each event to disk before it returns and delivers it in the
background exactly once; ``IngestClient`` (client.py) is the asyncio client underneath;
``rtrl_client.v1`` holds the generated messages (telemetry.proto, ingest.proto).
"""

from rtrl_client.client import IngestAuthError, IngestClient, IngestError, make_event
from rtrl_client.sdk import (
    DeliveryStats,
    RejectedEvent,
    SpoolFull,
    SpoolLocked,
    Telemetry,
    TelemetrySettings,
    edit_outcome,
    edit_shown,
    followup,
    persistence_snapshot,
)
from rtrl_client.version import __version__

__all__ = [
    "__version__",
    "DeliveryStats",
    "IngestAuthError",
    "IngestClient",
    "IngestError",
    "RejectedEvent",
    "SpoolFull",
    "SpoolLocked",
    "Telemetry",
    "TelemetrySettings",
    "edit_outcome",
    "edit_shown",
    "followup",
    "make_event",
    "persistence_snapshot",
]
