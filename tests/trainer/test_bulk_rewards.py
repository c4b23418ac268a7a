"""A reward whose rollout's bulk is out of band (rtrl/bulk.py) trains on exactly the bulk
the worker wrote: read back from the store and checked against the checksum the
joiner's MAC covers. A bulk gone from the store, rewritten in it, or a checksum changed
after the joiner sealed the reward, is counted by its reason and never trained on."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from rtrl import bulk
from rtrl.checkpoint import Checkpoint
from rtrl.reward_stream.config import RewardStreamSettings
from rtrl.trainer.batch import Drop, TrainSample
from rtrl.trainer.config import TrainerSettings
from rtrl.trainer.intake import Intake
from support.trainer import reward_record


@dataclass
class Message:
    """A consumed reward record, as the intake reads one."""

    payload: bytes
    header_list: list = field(default_factory=list)

    def value(self) -> bytes:
        return self.payload

    def headers(self) -> list:
        return self.header_list


@pytest.fixture
def store(tmp_path) -> bulk.BulkStore:
    return bulk.BulkStore(tmp_path / "rollout-bulk")


def intake(store: bulk.BulkStore) -> Intake:
    return Intake(TrainerSettings(), None, Checkpoint.builtin_demo(), None, None, store)


def sealed(record) -> Message:
    value = record.SerializeToString()
    return Message(value, list(RewardStreamSettings().reward_seal().headers(value)))


def out_of_band(store: bulk.BulkStore):
    """(the reward with its rollout whole, the same reward with its bulk in ``store``)."""
    whole = reward_record("p", [1, 5, 6], [7, 8, 2], [-0.5, -0.25, -0.125], 1.0)
    slim = type(whole)()
    slim.CopyFrom(whole)
    rollout, blob = bulk.split(whole.rollout)
    store.put(blob)
    slim.rollout.CopyFrom(rollout)
    return whole, slim


def test_a_reward_out_of_band_trains_on_the_same_tokens_as_inline(store):
    whole, slim = out_of_band(store)
    inline, fetched = intake(store)._sample(sealed(whole)), intake(store)._sample(sealed(slim))
    assert isinstance(inline, TrainSample) and isinstance(fetched, TrainSample)
    assert (fetched.prompt_ids, fetched.completion_ids, fetched.behaviour_logprobs) == (
        inline.prompt_ids,
        inline.completion_ids,
        inline.behaviour_logprobs,
    )


def test_a_bulk_gone_or_rewritten_or_renamed_is_never_trained_on(store):
    _, slim = out_of_band(store)
    path = store.path(slim.rollout.bulk.checksum)
    blob = path.read_bytes()
    path.write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
    assert intake(store)._sample(sealed(slim)) is Drop.BULK_CORRUPT
    path.unlink()
    assert intake(store)._sample(sealed(slim)) is Drop.BULK_UNAVAILABLE
    path.write_bytes(blob)
    message = sealed(slim)
    renamed = type(slim).FromString(message.payload)
    renamed.rollout.bulk.checksum = "sha256:" + "0" * 64
    message.payload = renamed.SerializeToString()  # after the joiner sealed it
    assert intake(store)._sample(message) is Drop.FORGED
    # The joiner's own MAC on a record naming no checksum at all: refused, not a crash.
    renamed.rollout.bulk.checksum = "sha256:../../../etc/passwd"
    assert intake(store)._sample(sealed(renamed)) is Drop.BULK_CORRUPT
    assert isinstance(intake(store)._sample(sealed(slim)), TrainSample)
