"""L1: whoever held any service's Redis password could write any heartbeat: a
forged joiner beat hid the reward-hacking alerts from `rtrl status`, an 8 MB junk beat made
it fail. Writing is now each service's own (tests/ops/test_redis_acl.py); here the reader,
on a real Redis: a beat is read only to its bound, must be the beat its key names, and one
that is not shows as that service's invalid heartbeat, never a crash."""

from __future__ import annotations

import json

import pytest
import redis

from rtrl import heartbeat
from rtrl.ops import health, status_view

ALERT = heartbeat.RewardAlert(
    metric="kept_rate",
    previous_version=1,
    version=2,
    previous_value=0.2,
    value=0.9,
    z_score=6.0,
    examples=("r-1",),
)


def store(client: redis.Redis, stored: str, service: str, instance: str, beat) -> None:
    client.set(stored, json.dumps(heartbeat.document(service, instance, beat)))


@pytest.mark.guarantee(7)
def test_junk_and_forged_beats_show_as_invalid_and_hide_nothing(redis_url):
    """L1: the joiner's real beat (an alert) beside an 8 MB junk beat under another joiner's
    key and a joiner beat forged under the gateway's key: the reader reads each only to
    MAX_BEAT_BYTES, keeps the real one's alert, and reports the other two invalid by name."""
    client = redis.Redis.from_url(redis_url)
    real = heartbeat.RewardStreamBeat(alerts=(ALERT,))
    store(client, heartbeat.key("reward_stream", "0"), "reward_stream", "0", real)
    client.set(heartbeat.key("reward_stream", "1"), b"{" * (8 << 20))
    forged = heartbeat.RewardStreamBeat(alerts=())
    store(client, heartbeat.key("ingest", "0"), "reward_stream", "0", forged)

    beats, invalid = heartbeat.read_checked(client)
    assert [b.name for b in beats] == ["reward_stream:0"]
    assert {i.name: i.reason for i in invalid} == {
        "ingest:0": "a reward_stream beat for reward_stream:0 stored under rtrl:hb:ingest:0",
        "reward_stream:1": f"a heartbeat over {heartbeat.MAX_BEAT_BYTES} bytes",
    }
    rows = [health.ComponentHealth(b.name, True, "", b.beat) for b in heartbeat.read(client)]
    assert status_view.hacking_alerts(rows) == [ALERT]
    with pytest.raises(heartbeat.HeartbeatError, match="over"):
        heartbeat.read_one(client, "reward_stream", "1")
    assert heartbeat.read_one(client, "reward_stream", "0") == beats[0]
    client.close()


def test_a_beat_at_the_bound_is_read_and_one_byte_over_is_not(redis_url):
    """The bound is exact: a document of the bound's size is a beat, one byte more is not."""
    client = redis.Redis.from_url(redis_url)
    stored = json.dumps(heartbeat.document("trainer", "0", heartbeat.TrainerBeat()))
    client.set(heartbeat.key("trainer", "0"), stored)
    beats, invalid = heartbeat.read_checked(client, len(stored))
    assert [b.name for b in beats] == ["trainer:0"] and not invalid
    beats, invalid = heartbeat.read_checked(client, len(stored) - 1)
    assert not beats and [i.name for i in invalid] == ["trainer:0"]
    client.close()
