"""A record's bulk out of band (rtrl/bulk.py): the record that travels keeps what its
readers count, the bulk comes back exactly, and a bulk that is not the one the record
names, or a record that names no bulk properly, is refused: never trained on."""

from __future__ import annotations

import tracemalloc

import pytest

from rtrl import bulk
from rtrl.trajectory import MalformedTrajectory, Trajectory
from rtrl.trajectory_summary import Summary
from rtrl.v1 import common_pb2, rollout_pb2
from support.trajectories import AGENT


def agent_record() -> rollout_pb2.RolloutRecord:
    written = rollout_pb2.RolloutRecord(
        event_id="e-1",
        rollout_id="r-1",
        client_ts_ms=1_800_000_000_000,
        arm=common_pb2.ARM_TREATMENT,
    )
    AGENT.write(written)
    written.router_choices.CopyFrom(
        rollout_pb2.RouterChoices(layers=1, top_k=1, expert_ids=b"\1" * 9)
    )
    return written


@pytest.fixture
def store(tmp_path) -> bulk.BulkStore:
    return bulk.BulkStore(tmp_path / "bulk")


def test_the_bulk_comes_back_exactly_and_the_record_keeps_what_its_readers_count(store):
    whole = agent_record()
    slim, blob = bulk.split(whole)
    assert store.put(blob) == slim.bulk.checksum and store.put(blob) == slim.bulk.checksum
    assert not slim.prompt_token_ids and not slim.segments and not slim.HasField("router_choices")
    assert not slim.tool_calls and slim.bulk.parallel_turns == 1
    assert slim.completion_text == "done" and slim.link.trajectory_id == "traj-1"
    assert slim.ByteSize() < 200  # a few hundred bytes at any length
    counted, expected = Summary.of(slim), Summary.of(whole)
    assert counted == Summary(**{**vars(expected), "prompt_text": "", "tool_calls": ()})
    assert [(c.name, c.calls, c.invalid) for c in counted.tool_counts] == [
        ("read", 2, 0),
        ("lint", 1, 1),
    ]
    assert bulk.inflate(slim, store) == whole
    assert Trajectory.of(bulk.inflate(slim, store)) == AGENT
    with pytest.raises(MalformedTrajectory, match="inflate it first"):
        Trajectory.of(slim)


def test_a_record_without_bulk_is_itself(store):
    whole = agent_record()
    assert bulk.inflate(whole, store) is whole


def tampered(blob: bytes) -> bytes:
    record = rollout_pb2.RolloutRecord.FromString(blob)
    record.segments[0].logprobs[0] = 0.0  # the sampled token made certain
    return record.SerializeToString()


def test_a_bulk_that_is_not_the_one_named_is_refused(store):
    """Rewritten in the store after the worker wrote it. (Naming another bulk would take
    rewriting the record, whose signature and MACs cover the checksum.)"""
    slim, blob = bulk.split(agent_record())
    store.put(blob)
    path = store.path(slim.bulk.checksum)
    path.write_bytes(tampered(blob))  # rewritten in the store after the worker wrote it
    with pytest.raises(bulk.BulkCorrupt, match="hashing to"):
        bulk.inflate(slim, store)


def test_a_gone_bulk_is_unavailable(store):
    slim, _ = bulk.split(agent_record())
    with pytest.raises(bulk.BulkUnavailable, match="no rollout bulk"):
        bulk.inflate(slim, store)


@pytest.mark.parametrize(
    "checksum",
    [
        "sha256:../../../etc/passwd",
        "sha256:" + "A" * 64,
        "md5:" + "0" * 32,
        "sha256:" + "0" * 63,
        "/etc/passwd",
        "",
    ],
)
def test_a_checksum_is_parsed_never_used_as_a_path(store, checksum):
    slim, _ = bulk.split(agent_record())
    slim.bulk.checksum = checksum
    with pytest.raises(ValueError, match="not sha256"):
        bulk.inflate(slim, store)


def test_a_bulk_that_sets_other_fields_or_a_record_that_keeps_its_bulk_inline_is_refused(store):
    slim, _ = bulk.split(agent_record())
    smuggled = rollout_pb2.RolloutRecord(prompt_token_ids=[1, 2], client_id="someone-else")
    blob = smuggled.SerializeToString()
    slim.bulk.checksum, slim.bulk.size = store.put(blob), len(blob)
    with pytest.raises(bulk.BulkCorrupt, match="sets client_id"):
        bulk.inflate(slim, store)
    both, blob = bulk.split(agent_record())
    store.put(blob)
    both.prompt_token_ids.extend([1, 2])
    with pytest.raises(bulk.BulkCorrupt, match="inline too"):
        bulk.inflate(both, store)


@pytest.mark.guarantee(7)
def test_l8_a_stored_bulk_larger_than_its_record_says_is_refused_before_it_is_read(store):
    """L8: the blob at a record's checksum is checked against the size the record names
    (signed with it) before it is read: a 256 MiB file planted there (sparse: it costs the
    disk nothing) is refused as BulkCorrupt with nothing of it in memory, where it was read
    whole first (+1.8 GB for a large one)."""
    slim, blob = bulk.split(agent_record())
    path = store.path(slim.bulk.checksum)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as planted:
        planted.truncate(256 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(bulk.BulkCorrupt, match="bytes"):
            bulk.inflate(slim, store)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak:,} bytes allocated to refuse a 256 MiB blob"
    path.write_bytes(blob)  # the real one, of the size named, still comes back
    assert bulk.inflate(slim, store).prompt_token_ids == agent_record().prompt_token_ids
