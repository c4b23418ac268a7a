"""reward_id is the version-5 UUID of its name: the fast formatting must equal uuid.uuid5's."""

import uuid

from hypothesis import given
from hypothesis import strategies as st

from rtrl.reward_stream.reward_wire import REWARD_ID_NAMESPACE, reward_id

ids = st.text(min_size=1, max_size=40)


@given(
    rollout_id=ids, event_ids=st.lists(ids, max_size=6), version=st.sampled_from(["r1", "r2", "r3"])
)
def test_reward_id_equals_uuid5(rollout_id, event_ids, version):
    name = "\x1f".join((version, rollout_id, *sorted(event_ids)))
    assert reward_id(rollout_id, event_ids, version) == str(uuid.uuid5(REWARD_ID_NAMESPACE, name))


def test_reward_id_ignores_event_order_and_names_the_version():
    assert reward_id("r1", ["b", "a"], "r1") == reward_id("r1", ["a", "b"], "r1")
    assert reward_id("r1", ["a"], "r1") != reward_id("r1", ["a"], "r2")
