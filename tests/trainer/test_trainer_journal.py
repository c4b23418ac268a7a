"""The trainer journal's replay: what was trained, where to resume, for every point a
crash can cut the sequence candidate -> (publish) -> published | refused."""

from __future__ import annotations

import pytest

from rtrl.trainer.journal import Journal

P0 = {"rl.reward.v1:0": 10, "rl.reward.v1:1": 4}
P1 = {"rl.reward.v1:0": 20, "rl.reward.v1:1": 9}


def _journal(tmp_path, *entries) -> Journal:
    journal = Journal(tmp_path)
    journal.reset(version=0)
    for kind, *args in entries:
        getattr(journal, kind)(*args)
    return journal


# (case, entries after reset at v0, registry latest, expected step, positions, trained, refused, landed)
CASES = [
    ("nothing trained yet", [], 0, 0, {}, [], [], False),
    (
        "published and journaled",
        [("candidate", 1, P0, ["a", "b"]), ("published", 1, 1)],
        1,
        1,
        P0,
        ["a", "b"],
        [],
        False,
    ),
    # Crash after the journal entry, before the publish: the candidate never left; read it again.
    ("crash before publish", [("candidate", 1, P0, ["a", "b"])], 0, 0, {}, [], [], False),
    # Crash after the publish, before "published" was written: the registry says it landed.
    ("crash after publish", [("candidate", 1, P0, ["a", "b"])], 1, 1, P0, ["a", "b"], [], True),
    (
        "refused",
        [("candidate", 1, P0, ["a"]), ("refused", 1, {"accepted": False})],
        0,
        1,
        P0,
        [],
        ["a"],
        False,
    ),
    (
        "refused then a crash before the next publish",
        [("candidate", 1, P0, ["a"]), ("refused", 1, {}), ("candidate", 2, P1, ["b"])],
        0,
        1,
        P0,
        [],
        ["a"],
        False,
    ),
    (
        "a retried step supersedes the voided candidate",
        [("candidate", 1, P0, ["a"]), ("candidate", 1, P1, ["a", "b"]), ("published", 1, 1)],
        1,
        1,
        P1,
        ["a", "b"],
        [],
        False,
    ),
]


@pytest.mark.parametrize(
    ("entries", "latest", "step", "positions", "trained", "refused", "landed"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_replay(tmp_path, entries, latest, step, positions, trained, refused, landed):
    state = _journal(tmp_path, *entries).replay(latest)
    assert (state.step, state.positions, list(state.trained), list(state.refused)) == (
        step,
        positions,
        trained,
        refused,
    )
    assert state.in_flight_published is landed
    assert state.last_published_version == latest


def test_a_torn_append_is_dropped_and_the_next_append_starts_clean(tmp_path):
    journal = _journal(tmp_path, ("candidate", 1, P0, ["a"]), ("published", 1, 1))
    with open(journal.path, "a") as f:
        f.write('{"kind":"candidate","step":2,"positi')
    reopened = Journal(tmp_path)
    assert reopened.replay(1).trained == ("a",)
    reopened.candidate(2, P1, ["b"])
    reopened.published(2, 2)
    assert Journal(tmp_path).replay(2).trained == ("a", "b")


def test_compaction_keeps_positions_step_and_the_newest_ids(tmp_path):
    journal = _journal(
        tmp_path,
        ("candidate", 1, P0, ["a", "b"]),
        ("published", 1, 1),
        ("candidate", 2, P1, ["c"]),
        ("refused", 2, {}),
    )
    journal.compact(registry_latest=1, keep_ids=2)
    state = Journal(tmp_path).replay(1)
    assert (state.step, state.positions, state.last_published_version) == (2, P1, 1)
    assert state.recent_ids == ("b", "c")
    assert journal.path.read_text().count("\n") == 1


def test_reset_starts_a_new_lineage(tmp_path):
    journal = _journal(tmp_path, ("candidate", 1, P0, ["a"]), ("published", 1, 1))
    journal.reset(version=0)
    state = journal.replay(0)
    assert (state.step, state.positions, state.recent_ids) == (0, {}, ())


@pytest.mark.parametrize(
    "entries, latest, cluster_id",
    [
        # The positions name the cluster they are offsets in, through every path to them.
        ([("candidate", 1, P0, ["a"], "cluster-a"), ("published", 1, 1)], 1, "cluster-a"),
        ([("candidate", 1, P0, ["a"], "cluster-a"), ("refused", 1, {})], 0, "cluster-a"),
        ([("candidate", 1, P0, ["a"], "cluster-a")], 1, "cluster-a"),  # landed before the crash
        (
            [
                ("candidate", 1, P0, ["a"], "cluster-a"),
                ("published", 1, 1),
                ("candidate", 2, P1, ["b"], "cluster-b"),
            ],
            1,
            "cluster-a",
        ),
        ([], 0, ""),
    ],
)
def test_positions_carry_their_broker_cluster_through_replay_and_compaction(
    tmp_path, entries, latest, cluster_id
):
    journal = _journal(tmp_path, *entries)
    assert journal.replay(latest).cluster_id == cluster_id
    journal.compact(latest, keep_ids=10)
    assert Journal(tmp_path).replay(latest).cluster_id == cluster_id
