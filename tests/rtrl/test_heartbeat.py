"""Heartbeats are typed on both ends: what a service writes is what `rtrl status` reads,
and a reader one release apart from the writer still understands it."""

import dataclasses
import json

import pytest

from rtrl import heartbeat
from rtrl.heartbeat import (
    AnalyticsBeat,
    GateRefusal,
    GateVerdict,
    InferenceBeat,
    IngestBeat,
    RegistryRebuild,
    RewardAlert,
    RewardByVersion,
    RewardStreamBeat,
    TrainerBeat,
    WeightSyncBeat,
)

ALERT = RewardAlert(
    "clarifying_question",
    3,
    4,
    0.05,
    0.31,
    6.2,
    ("r1", "r2"),
    kind="drift",
    first_version=2,
    samples=80,
)
BEATS: dict[str, heartbeat.Beat] = {
    "ingest": IngestBeat(accepted=10, duplicate=2, rejected=1, inflight=3),
    "reward_stream": RewardStreamBeat(
        events=40,
        settled=9,
        partitions=(0, 3),
        alerts=(ALERT,),
        reward_by_version=(RewardByVersion(0, 20, 0.5),),
        assigned=2,
    ),
    "trainer": TrainerBeat(
        step=7,
        version=5,
        reward_mean=0.25,
        dropped={"stale": 1},
        gate=GateVerdict(True, {"ok": 1.0}, {"ok": 0.9}, {"ok": 0.8}),
        refused=1,
        refusals=(
            GateRefusal(
                3,
                1_700_000_000_000,
                32,
                False,
                {"ok": 0.1},
                {"ok": 0.9},
                {"ok": 0.8},
                ("ok vs published: 0.100 < 0.900 - 0.1",),
            ),
        ),
    ),
    "inference": InferenceBeat(
        ready=True,
        versions={"control": 0, "treatment": 5},
        weights_digests={"control": "ab"},
        worker_id="w1",
    ),
    "weight_sync": WeightSyncBeat(
        port=50061,
        latest={"treatment": 5},
        last_registry_rebuild=RegistryRebuild(1, {"treatment": 4}),
    ),
    "analytics": AnalyticsBeat(consumed=5, pending=1, inserted={"rollouts": 4}),
}


@pytest.mark.parametrize("service", BEATS)
def test_a_beat_reads_back_as_it_was_written(service):
    beat = BEATS[service]
    stored = json.dumps(heartbeat.document(service, "0", beat, ts=12.5))
    read = heartbeat.parse(stored)
    assert (read.service, read.instance, read.ts, read.name) == (service, "0", 12.5, f"{service}:0")
    assert read.beat == beat


def test_a_field_a_newer_writer_added_is_ignored_and_one_an_older_writer_lacks_takes_its_default():
    doc = heartbeat.document("trainer", "0", BEATS["trainer"])
    doc["a_field_from_the_future"] = {"nested": [1, 2]}
    del doc["refusals"], doc["reward_mean"]
    beat = heartbeat.parse(doc).beat
    assert isinstance(beat, TrainerBeat)
    written = BEATS["trainer"]
    assert isinstance(written, TrainerBeat)
    assert beat == dataclasses.replace(written, refusals=(), reward_mean=None)


def test_the_wire_document_is_flat_json_with_the_envelope_beside_the_fields():
    doc = json.loads(json.dumps(heartbeat.document("inference", "7", BEATS["inference"], ts=1.0)))
    assert doc["service"] == "inference" and doc["instance"] == "7" and doc["ts"] == 1.0
    assert doc["versions"] == {"control": 0, "treatment": 5} and doc["ready"] is True


@pytest.mark.parametrize(
    "stored, error",
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (json.dumps({"service": "mystery", "instance": "0", "ts": 0}), "unknown service 'mystery'"),
    ],
)
def test_a_document_no_reader_understands_is_a_clear_error(stored, error):
    with pytest.raises(heartbeat.HeartbeatError, match=error):
        heartbeat.parse(stored)


def test_a_service_cannot_send_another_services_beat():
    with pytest.raises(TypeError, match="trainer beats are TrainerBeat, not IngestBeat"):
        heartbeat.document("trainer", "0", IngestBeat())
