"""Files the stack appends to forever, kept to a size: span and metric files, and logs.

The embedded stack writes spans and metrics as JSON lines (rtrl/otel.py) and every
process's output to ``<state_dir>/logs/``; each grows with traffic (a span per reward, a
log line per refusal), so a client could fill the disk with requests alone. Each file is
bounded: past ``max_bytes`` it becomes ``<name>.1`` (replacing the previous one) and
writing starts over, so a file and its one predecessor hold at most twice the bound.

Two writers, two ways:

* ``RotatingText``: a writer that owns its file (the OpenTelemetry file exporters) renames
  it and opens a new one when the next line would pass the bound;
* ``rotate_if_over``: files other processes write through ``O_APPEND`` descriptors (the
  services' output, which the supervisor opened for them) cannot be renamed under their
  writers, so they are copied to ``<name>.1`` and truncated in place (logrotate's
  ``copytruncate``): each writer's next line lands at the new end. A line written between
  the copy and the truncation is lost; that is the price of not restarting the writer.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import IO


def backup_of(path: Path) -> Path:
    """Where ``path``'s previous contents go when it is rotated."""
    return path.with_name(path.name + ".1")


class RotatingText:
    """A text file appended to in lines, rotated before it would pass ``max_bytes``.

    Enough of a text stream for the OpenTelemetry console exporters (``write``,
    ``flush``, ``close``); created owner-only, as everything the stack writes."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.path = path
        self.max_bytes = max_bytes
        self._file = self._open()
        self._size = self._file.tell()

    def _open(self) -> IO[str]:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        file = os.fdopen(fd, "a", encoding="utf-8")
        file.seek(0, os.SEEK_END)
        return file

    def write(self, text: str) -> int:
        size = len(text.encode("utf-8"))
        if self._size and self._size + size > self.max_bytes:
            self._file.close()
            os.replace(self.path, backup_of(self.path))
            self._file = self._open()
            self._size = 0
        self._size += size
        return self._file.write(text)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def rotate_if_over(path: Path, max_bytes: int) -> bool:
    """Copy ``path`` to its backup and truncate it when it is over ``max_bytes`` (see the
    module docstring); whether it did. A file that is gone is no error."""
    try:
        if path.stat().st_size <= max_bytes:
            return False
    except FileNotFoundError:
        return False
    backup = backup_of(path)
    with (
        path.open("rb") as source,
        open(os.open(backup, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as copy,
    ):
        shutil.copyfileobj(source, copy)
    os.truncate(path, 0)
    return True
