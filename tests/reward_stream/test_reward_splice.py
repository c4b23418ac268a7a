"""The joiner's reward records carry the rollout's own bytes, spliced in: they must
parse to exactly the record reward_record builds with the rollout set."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rtrl import topics
from rtrl.reward_stream import reward, reward_wire
from rtrl.reward_stream.config import RewardStreamSettings
from rtrl.reward_stream.runtime import Joiner
from rtrl.v1 import reward_pb2, rollout_pb2
from rtrl_client.v1 import telemetry_pb2

tokens = st.lists(st.integers(min_value=0, max_value=200_000), max_size=300)


@settings(max_examples=200, deadline=None)
@given(
    token_ids=tokens,
    text=st.text(max_size=400),
    spans=st.lists(
        st.tuples(st.integers(0, 50), st.integers(0, 999), st.integers(0, 999)), max_size=3
    ),
    snapshot=st.text(max_size=200),
    version=st.sampled_from(sorted(reward.FUNCTIONS)),
)
def test_spliced_record_equals_the_built_one(token_ids, text, spans, snapshot, version):
    rollout = rollout_pb2.RolloutRecord(
        event_id="e1",
        rollout_id="r1",
        client_ts_ms=10,
        completion_text=text,
        completion_token_ids=token_ids,
        completion_logprobs=[-0.5] * len(token_ids),
        version_spans=[
            rollout_pb2.VersionSpan(policy_version=v, start=s, end=e) for v, s, e in spans
        ],
    )
    telemetry = [
        telemetry_pb2.TelemetryEvent(
            event_id="e2",
            rollout_id="r1",
            client_ts_ms=20,
            persistence=telemetry_pb2.PersistenceSnapshot(region_text=snapshot),
        )
    ]
    bare = reward.reward_record(rollout, telemetry, 99, version, with_rollout=False)
    assert not bare.HasField("rollout")
    spliced = reward_pb2.RewardRecord.FromString(
        reward_wire.encode_with_rollout(bare, rollout.SerializeToString())
    )
    assert spliced == reward.reward_record(rollout, telemetry, 99, version)


def test_splicing_into_a_record_that_has_a_rollout_is_refused():
    # The parser would merge the two rollouts into one: refuse instead.
    full = reward.reward_record(
        rollout_pb2.RolloutRecord(event_id="e1", rollout_id="r1", client_ts_ms=1), [], 5
    )
    with pytest.raises(ValueError, match="already holds a rollout"):
        reward_wire.encode_with_rollout(full, b"")


def test_joiner_publishes_the_rollout_bytes_as_written():
    # A field this version does not know (number 999) survives into the reward.
    rollout = rollout_pb2.RolloutRecord(
        event_id="e1", rollout_id="r1", client_ts_ms=1000, completion_token_ids=[5, 6, 7]
    )
    unknown = b"\xba\x3e\x03abc"  # field 999, length-delimited, "abc"
    raw = rollout.SerializeToString() + unknown
    joiner = Joiner(RewardStreamSettings().join_config())
    assert joiner.feed(topics.ROLLOUT, 0, 0, b"r1", raw, now_ms=0) == []
    [out] = joiner.tick(now_ms=10**7)
    record = reward_pb2.RewardRecord.FromString(out.value)
    assert record.rollout.SerializeToString() == raw
    assert record.rollout.completion_token_ids == [5, 6, 7]
