"""Report what a user did with one edit, the way a product would.

    RTRL_INGEST_URL=http://127.0.0.1:8081 RTRL_API_KEY=rtrl_... \
        python send_events.py --rollout-id <the id the serving API returned> --spool /tmp/rtrl-spool

Prints one JSON line per event sent (its event_id, the gateway's dedup key), then the
delivery counts. Run it twice with the same spool after killing it mid-way: what was
spooled is delivered by the second run, and nothing twice.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid

from rtrl_client import Telemetry


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("RTRL_INGEST_URL", "http://127.0.0.1:8081"))
    parser.add_argument("--rollout-id", default=str(uuid.uuid4()))
    parser.add_argument("--spool", default="./rtrl-spool", help="the durable spool directory")
    args = parser.parse_args()
    ids = dict(rollout_id=args.rollout_id, session_id="example-session", user_id="example-user")
    with Telemetry(args.url, api_key=os.environ.get("RTRL_API_KEY"), spool_dir=args.spool) as t:
        sent = [
            t.edit_shown(**ids, file_path="app.py", edit_text="x = 1\n"),
            t.edit_outcome(**ids, outcome="accepted"),
            t.persistence_snapshot(**ids, seconds_after_edit=60, region_text="x = 1\n"),
            t.followup(**ids, seconds_after_edit=5, message="thanks, that works"),
        ]
        for event in sent:
            print(json.dumps({"event_id": event.event_id, "payload": event.WhichOneof("payload")}))
        delivered = t.flush(timeout_s=30)
        stats = t.stats
    print(
        json.dumps(
            {
                "delivered": delivered,
                "accepted": stats.accepted,
                "duplicate": stats.duplicate,
                "rejected": stats.rejected,
            }
        )
    )
    return 0 if delivered and not stats.rejected else 1


if __name__ == "__main__":
    sys.exit(main())
