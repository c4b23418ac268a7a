"""What one bad file in a spool directory may cost the Python SDK (rtrl_client/spool.py,
spool_lock.py): a damaged record costs that record only; files the spool did not write are
neither read, nor deleted, nor a reason not to start; no symbolic link is followed; a lock
whose owner is gone is taken over, and a live owner's is not. The Node SDK's twin tests,
and the two SDKs on one directory, are in clients/typescript/test/spool.test.mjs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rtrl_client.spool import MARK, Spool, SpoolLocked
from rtrl_client.spool_lock import Owner, process_started

EVENTS = [b"event-%02d" % i for i in range(8)]


def open_spool(directory: Path) -> Spool:
    return Spool(directory, max_bytes=1 << 20, segment_bytes=1 << 16, fsync=False)


def payloads(spool: Spool) -> list[bytes]:
    return [item.payload for item in spool.oldest(1 << 30)]


def spooled(directory: Path) -> Path:
    """A directory holding EVENTS in one segment; the segment's path."""
    spool = open_spool(directory)
    spool.append(EVENTS)
    spool.close()
    (segment,) = directory.glob("*.seg")
    return segment


RECORD = len(MARK) + 8 + len(EVENTS[0])


@pytest.mark.guarantee(7)
@pytest.mark.parametrize(
    "where",
    [len(MARK) + 8 + 3, len(MARK) + 1, 0],
    ids=["a payload byte", "a length byte", "the mark"],
)
def test_a_flipped_byte_costs_its_record_and_no_other(tmp_path, where):
    """L7: one flipped byte in the third record of eight: the seven others are still sent,
    in order, and what is appended after them too."""
    segment = spooled(tmp_path)
    data = bytearray(segment.read_bytes())
    data[2 * RECORD + where] ^= 0x40
    segment.write_bytes(bytes(data))

    spool = open_spool(tmp_path)
    assert payloads(spool) == EVENTS[:2] + EVENTS[3:]
    spool.append([b"after"])
    spool.close()
    again = open_spool(tmp_path)
    assert payloads(again) == EVENTS[:2] + EVENTS[3:] + [b"after"]
    again.ack([item.seq for item in again.oldest(100)])
    assert not list(tmp_path.glob("*.seg"))
    again.close()


@pytest.mark.guarantee(7)
def test_files_the_spool_did_not_write_are_ignored_and_kept(tmp_path):
    """L7: names a digit test would let through ("²", two hundred digits), a directory
    with a segment's name, another program's ``.acks``: the SDK starts, sends its own
    records, and deletes none of them."""
    spooled(tmp_path)
    foreign = ["².seg", "9" * 200 + ".seg", "notes.seg", "mine.acks", "5.acks", "LOCK"]
    for name in foreign:
        (tmp_path / name).write_bytes(b"not the spool's")
    (tmp_path / "0000000000000042.seg").mkdir()

    spool = open_spool(tmp_path)
    assert payloads(spool) == EVENTS
    spool.ack([item.seq for item in spool.oldest(100)])
    spool.close()
    for name in foreign:
        assert (tmp_path / name).read_bytes() == b"not the spool's", name
    assert (tmp_path / "0000000000000042.seg").is_dir()


@pytest.mark.guarantee(7)
def test_a_symlinked_spool_is_refused_and_its_target_left_as_it_was(tmp_path):
    """L7: a spool path that is a symbolic link is refused, and the directory it points at
    keeps its mode; a segment that is a link to another file is not read."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    (tmp_path / "spool").symlink_to(shared)
    with pytest.raises(OSError, match="not a directory of its own"):
        open_spool(tmp_path / "spool")
    assert shared.stat().st_mode & 0o777 == 0o755

    elsewhere = tmp_path / "elsewhere"
    segment = spooled(elsewhere)
    own = tmp_path / "own"
    own.mkdir()
    (own / segment.name).symlink_to(segment)
    spool = open_spool(own)
    assert payloads(spool) == []
    spool.close()
    assert (own / segment.name).is_symlink() and len(open_spool(elsewhere)) == len(EVENTS)


def write_lock(directory: Path, pid: int, started: str, host: str | None = None) -> None:
    owner = {"pid": pid, "host": host or socket.gethostname(), "started": started}
    directory.mkdir(exist_ok=True)
    (directory / "spool.lock").write_text(json.dumps(owner) + "\n")


@pytest.mark.guarantee(7)
def test_a_lock_whose_owner_is_gone_is_taken_over(tmp_path):
    """L7: a lock naming a dead pid, or a live pid that started at another moment (reused
    after a reboot), or holding no owner at all, is stale: the SDK starts."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    parent = os.getppid()
    for pid, started in [(dead.pid, ""), (parent, "another-boot/1"), (0, "")]:
        write_lock(tmp_path, pid, started)
        spool = open_spool(tmp_path)
        assert Owner.parse((tmp_path / "spool.lock").read_text()) == Owner.me()
        spool.close()
        assert not (tmp_path / "spool.lock").exists()
    (tmp_path / "spool.lock").write_text("garbage")
    open_spool(tmp_path).close()


@pytest.mark.guarantee(7)
def test_a_live_owners_lock_or_another_hosts_is_kept(tmp_path):
    """A lock naming a running process as it started, or a process on another host (whose
    life this host cannot see), is not taken: SpoolLocked says whose it is."""
    parent = os.getppid()
    write_lock(tmp_path, parent, process_started(parent))
    with pytest.raises(SpoolLocked, match=f"process {parent}"):
        open_spool(tmp_path)
    write_lock(tmp_path, 2_000_000_000, "", host="elsewhere")
    with pytest.raises(SpoolLocked, match="elsewhere"):
        open_spool(tmp_path)
    assert json.loads((tmp_path / "spool.lock").read_text())["host"] == "elsewhere"
