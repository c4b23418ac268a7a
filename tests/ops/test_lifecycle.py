"""`rtrl up`'s state directory: resumed by default, emptied only by --fresh, and only
when it is one (a marker says so)."""

import pytest

from rtrl.ops import statedir


def _run_left_behind(state_dir):
    (state_dir / "cache").mkdir()
    (state_dir / "cache" / "warmstart-x.safetensors").write_bytes(b"w")
    (state_dir / "chdb").mkdir()
    (state_dir / "chdb" / "data").write_bytes(b"old rows")
    (state_dir / "stack.json").write_text("{}")


def test_a_new_directory_becomes_an_owner_only_state_directory(tmp_path):
    state_dir = tmp_path / "new" / "state"
    statedir.prepare(state_dir, fresh=False)
    assert statedir.is_state_dir(state_dir)
    assert state_dir.stat().st_mode & 0o777 == 0o700


def test_up_resumes_everything_a_state_directory_holds(tmp_path):
    first = statedir.prepare(tmp_path, fresh=False)
    _run_left_behind(tmp_path)
    again = statedir.prepare(tmp_path, fresh=False)
    assert again == first, "resuming keeps the lineage's start"
    assert (tmp_path / "chdb" / "data").read_bytes() == b"old rows"
    assert (tmp_path / "stack.json").exists()


def test_fresh_empties_a_state_directory_but_keeps_the_warm_start_cache(tmp_path):
    first = statedir.prepare(tmp_path, fresh=False)
    _run_left_behind(tmp_path)
    again = statedir.prepare(tmp_path, fresh=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["cache", statedir.MARKER])
    assert (tmp_path / "cache" / "warmstart-x.safetensors").exists()
    assert again.created_ts >= first.created_ts


@pytest.mark.parametrize("fresh", [False, True])
def test_up_refuses_a_non_empty_directory_that_is_not_a_state_directory(tmp_path, fresh):
    # A scratch directory (or RTRL_STATE_DIR=. in a checkout) is refused, untouched.
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "chdb").mkdir()
    (tmp_path / "chdb" / "data").write_bytes(b"rows")
    with pytest.raises(statedir.NotAStateDir, match="notes.txt"):
        statedir.prepare(tmp_path, fresh=fresh)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert (tmp_path / "chdb" / "data").exists()
    assert not statedir.is_state_dir(tmp_path)


def test_a_file_is_not_a_state_directory(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(statedir.NotAStateDir):
        statedir.prepare(tmp_path / "f", fresh=True)


def test_a_state_directory_from_before_the_marker_is_adopted_and_resumed(tmp_path):
    # Only entries an rtrl stack writes: an earlier version's state directory.
    _run_left_behind(tmp_path)
    statedir.prepare(tmp_path, fresh=False)
    assert statedir.is_state_dir(tmp_path)
    assert (tmp_path / "chdb" / "data").exists()


def test_rtrl_up_refuses_a_checkout(tmp_path):
    """`rtrl up` itself, on a directory that holds someone's files: a clear error and no
    process started."""
    import io

    from rich.console import Console

    from rtrl.ops.lifecycle import StackError, up

    (tmp_path / "README.md").write_text("a checkout")
    with pytest.raises(StackError, match="not an rtrl state directory"):
        up(tmp_path, Console(file=io.StringIO()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md"]
