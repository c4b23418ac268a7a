"""Blob store on a local directory: ``<root>/<arm>/<version>.blob``.

Blobs are written to a temporary file, fsynced and renamed into place, so a reader
sees a whole blob or none. One server owns a directory. An S3 store would offer the
same three methods and ``s3://`` URIs.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlparse

# Arm names become directory names: no separators, no leading dot.
_ARM = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


def check_arm(arm: str) -> str:
    if not _ARM.fullmatch(arm):
        raise ValueError(f"arm {arm!r} is not a valid arm name (letters, digits, '_', '.', '-'; at most 64)")
    return arm


class BlobStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()

    def path(self, arm: str, version: int) -> Path:
        return self.root / check_arm(arm) / f"{version}.blob"

    def write(self, arm: str, version: int, blob: bytes) -> str:
        """Store the blob durably and return its URI."""
        final = self.path(arm, version)
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=f".{version}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(blob)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, final)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return final.as_uri()

    def read(self, blob_uri: str) -> bytes:
        """The blob's bytes; FileNotFoundError if it is gone."""
        return self._local_path(blob_uri).read_bytes()

    def exists(self, blob_uri: str) -> bool:
        return self._local_path(blob_uri).is_file()

    def _local_path(self, blob_uri: str) -> Path:
        parsed = urlparse(blob_uri)
        if parsed.scheme != "file":
            raise ValueError(f"blob URI {blob_uri!r} is not a file:// URI")
        path = Path(unquote(parsed.path)).resolve()
        if not path.is_relative_to(self.root):
            raise ValueError(f"blob URI {blob_uri!r} points outside the store at {self.root}")
        return path
