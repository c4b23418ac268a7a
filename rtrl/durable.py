"""Files that are whole or absent for readers, and survive a power cut once written."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_durably(final: Path, data: bytes) -> None:
    """Write to a temporary file, fsync, rename into place and fsync the directory, so
    the file is whole or absent for readers and survives a power cut once this returns."""
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    directory = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
