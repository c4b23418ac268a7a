"""How long each client-supplied string that travels may be, one table for both doors.

A string a client sends that the stack copies onward (into a rollout record, an event,
a reward, a ClickHouse row) costs the broker, the joiner and the analytics sink once per
copy, so each has a bound enforced where it enters: the serving API (inference/api.py,
a 400 naming the field) and the ingest gateway (ingest/validation.py, a rejection naming
the field). The two doors share these numbers because one rollout's ids arrive through
both: a user id the serving API took must not be one the gateway refuses.

They are protocol bounds, not operator knobs, so they are constants: a deployment that
raised one at a single door would break the other. The per-key budgets (requests and
bytes per second) are the knobs (rtrl/key_budgets.py, IngestSettings).
"""

from __future__ import annotations

import re

MAX_ID_CHARS = 128
"""rollout_id, session_id, user_id (both doors) and trajectory_id: at most this many
characters. An id is a key of the joiner's state, a Redis key and an analytics column."""

MAX_TEXT_BYTES = 64 * 1024
"""An event's edit text, region text or follow-up message: at most this many bytes of UTF-8."""

MAX_PATH_BYTES = 4 * 1024
"""An edit's file path: at most this many bytes of UTF-8 (PATH_MAX on Linux)."""

GROUP_ID = re.compile(r"[A-Za-z0-9._:/@-]{0,128}")
"""What a request's prompt_group_id may hold: ASCII letters, digits and ``._:/@-``, at most
128 of them (context_key's allow-list). It groups rollouts for the trainer's baseline and
is copied into the rollout, its reward and the analytics sink's rows."""
