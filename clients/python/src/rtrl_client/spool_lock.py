"""One owner per spool directory, by a protocol the Node SDK speaks too
(clients/typescript/src/spool.ts): two senders on one directory would resend each other's
events, whichever SDK each is.

Node has no ``flock``, so the lock is a file: ``spool.lock`` holds its owner as one line of
JSON, ``{"pid": 4242, "host": "build-7", "started": "<boot id>/<start tick>"}``. It is
written whole under a temporary name and hard-linked into place, which fails if a lock
exists, so nobody ever reads a half-written lock. A lock is stale, and taken over, when its
owner is gone: on this host, a process with its pid that is not running, or running but
started at another moment (the pid was reused: after a reboot, or by a long-lived process),
or a lock that is not one at all (unreadable JSON). A lock from another host is never
judged: SpoolLocked names the host, and a person removes it.

A stale lock is moved aside (rename, atomic) before it is looked at again, and put back if
what was moved aside is no longer the stale lock judged (a new owner took it over first).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

LOCK = "spool.lock"
_ATTEMPTS = 5


class SpoolLocked(RuntimeError):
    """Another process uses this spool directory; two senders would resend each other's events."""


@dataclass(frozen=True)
class Owner:
    """Who holds a spool: what ``spool.lock`` says."""

    pid: int
    host: str
    started: str
    """``<boot id>/<start tick>`` of the process (Linux); empty where that is unknown."""

    @classmethod
    def me(cls) -> Owner:
        return cls(os.getpid(), socket.gethostname(), process_started(os.getpid()))

    @classmethod
    def parse(cls, text: str) -> Owner | None:
        """The owner a lock names, or None when it names none."""
        try:
            fields = json.loads(text)
            owner = cls(int(fields["pid"]), str(fields["host"]), str(fields["started"]))
        except (ValueError, TypeError, KeyError):
            return None
        return owner if owner.pid > 0 else None

    def line(self) -> str:
        return json.dumps({"pid": self.pid, "host": self.host, "started": self.started}) + "\n"

    def gone(self) -> bool:
        """Whether this owner (on this host) no longer runs."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass  # it runs, as another user
        return bool(self.started) and process_started(self.pid) not in ("", self.started)


def process_started(pid: int) -> str:
    """When process ``pid`` started, as ``<boot id>/<start tick>`` (Linux's /proc); empty
    where the system does not say."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    # The command name (field 2) may hold spaces and parentheses: count after its last ")".
    fields = stat[stat.rfind(")") + 2 :].split()
    return f"{boot}/{fields[19]}" if len(fields) > 19 else ""


class SpoolLock:
    """This process's hold on a directory; ``release`` ends it."""

    def __init__(self, directory: Path, owner: Owner) -> None:
        self.path = directory / LOCK
        self.owner = owner
        self.released = False

    @classmethod
    def acquire(cls, directory: Path) -> SpoolLock:
        """Hold ``directory``, taking over a stale lock. Raises SpoolLocked."""
        owner = Owner.me()
        path = directory / LOCK
        temporary = directory / f"{LOCK}.{owner.pid}.{secrets.token_hex(6)}"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, owner.line().encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            for _ in range(_ATTEMPTS):
                try:
                    os.link(temporary, path, follow_symlinks=False)
                    return cls(directory, owner)
                except FileExistsError:
                    pass
                _take_over_if_stale(directory, owner)
            raise SpoolLocked(f"spool {directory}: could not take {LOCK} (contended)")
        finally:
            temporary.unlink(missing_ok=True)

    def release(self) -> None:
        """Remove the lock if it is still this process's."""
        if self.released:
            return
        self.released = True
        try:
            if Owner.parse(self.path.read_text()) == self.owner:
                self.path.unlink()
        except OSError:
            pass  # already gone


def _take_over_if_stale(directory: Path, me: Owner) -> None:
    """Remove the lock in ``directory`` if its owner is gone; raise SpoolLocked if it is not."""
    path = directory / LOCK
    try:
        text = _read_lock(path)
    except FileNotFoundError:
        return  # released meanwhile: try again
    holder = Owner.parse(text)
    if holder is not None and holder.host != me.host:
        raise SpoolLocked(
            f"spool {directory} is held by process {holder.pid} on host {holder.host!r}; "
            f"if that process is gone, remove {path}"
        )
    if holder is not None and not holder.gone():
        raise SpoolLocked(f"spool {directory} is in use by process {holder.pid}")
    aside = directory / f"{LOCK}.stale.{me.pid}.{secrets.token_hex(6)}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    if _read_lock(aside) != text:
        # A new owner's lock, taken between our read and our rename: put it back.
        try:
            os.link(aside, path, follow_symlinks=False)
        except FileExistsError:
            pass
    aside.unlink()


def _read_lock(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as file:
        return file.read(4096).decode("utf-8", "replace")
