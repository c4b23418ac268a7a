"""Input records are acknowledged per partition in the order they were read, never past
one still waiting: what keeps faust from committing past a pending rollout."""

import pytest

from rtrl.reward_stream.acks import OrderedAcks


class Record:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def ack(self) -> None:
        self.log.append(self.name)


# (finish order of the records read as p0:a p0:b p1:x p0:c p1:y, acks expected after each)
CASES = {
    "in_order": (["a", "b", "x", "c", "y"], [["a"], ["b"], ["x"], ["c"], ["y"]]),
    # b finishes first but waits for a; a releases both.
    "head_waits": (["b", "a", "c", "x", "y"], [[], ["a", "b"], ["c"], ["x"], ["y"]]),
    # a pending record holds only its own partition back.
    "other_partition_flows": (["b", "c", "y", "x", "a"], [[], [], [], ["x", "y"], ["a", "b", "c"]]),
}


@pytest.mark.parametrize("finish, expected", CASES.values(), ids=CASES.keys())
def test_acks_follow_read_order_per_partition(finish, expected):
    log: list[str] = []
    acks = OrderedAcks()
    tickets = {
        name: acks.read(partition, Record(log, name))
        for partition, name in (("p0", "a"), ("p0", "b"), ("p1", "x"), ("p0", "c"), ("p1", "y"))
    }
    for name, after in zip(finish, expected, strict=True):
        before = len(log)
        acks.done(tickets[name])
        assert log[before:] == after, name
    assert acks.waiting() == 0


def test_forgotten_partitions_are_never_acked():
    log: list[str] = []
    acks = OrderedAcks()
    a = acks.read("p0", Record(log, "a"))
    b = acks.read("p0", Record(log, "b"))
    acks.done(b)
    acks.forget({"p0"})
    acks.done(a)
    assert log == [] and acks.waiting() == 0
