"""Where version blobs live: ``<root>/<arm>/<version>.blob`` in a local directory,
or ``s3://bucket/prefix/<arm>/<version>.blob`` in S3 (store_s3.py). Each committed
version's serialized manifest lies beside its blob as ``<version>.manifest``,
written after the blob and before the Redis commit, so a lost registry can be
rebuilt from the store (recovery.py).

Both stores offer the same blocking methods (the servicer runs them in threads).
A reader sees a whole blob or manifest or none; reads verify no checksum (the servicer
checks the manifest's) but raise FileNotFoundError for a file that is gone, so a
collected or lost blob takes the same repair path on either store. A blob is read only
once the store says it is the size its signed manifest declares (stat, HEAD), and never
past that size, so a bad or planted file costs a stat, not its size in memory; a manifest
is read only up to MAX_MANIFEST_BYTES.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from rtrl.config import StackSettings, local_directory
from rtrl.durable import write_durably
from rtrl.weight_sync.config import WeightSyncSettings

MAX_MANIFEST_BYTES = 64 << 20
"""The largest stored manifest read: a manifest lists each tensor's name, shape and checksum,
a few MB for the largest models; a larger file is not one weight_sync wrote."""


class BlobSizeMismatch(ValueError):
    """The stored blob (or manifest) is not the size its manifest declares (or over the
    bound): never read, and never served."""


def check_size(uri: str, stored: int, declared: int) -> None:
    """Raise BlobSizeMismatch unless the store's ``stored`` size is the ``declared`` one."""
    if stored != declared:
        raise BlobSizeMismatch(
            f"{uri} is {stored:,} bytes in the store, not the {declared:,} its manifest declares"
        )


# Arm names become directory names and key segments: no separators, no leading dot.
_ARM = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_BLOB_NAME = re.compile(r"(0|[1-9][0-9]*)\.blob")
_STORED_NAME = re.compile(r"(0|[1-9][0-9]*)\.(blob|manifest)")


def check_arm(arm: str) -> str:
    if not _ARM.fullmatch(arm):
        raise ValueError(
            f"arm {arm!r} is not a valid arm name (letters, digits, '_', '.', '-'; at most 64)"
        )
    return arm


def blob_name(arm: str, version: int) -> str:
    """``<arm>/<version>.blob``, the blob's name relative to the store's root."""
    if version < 0:
        raise ValueError(f"version {version} of arm {arm!r} is negative")
    return f"{check_arm(arm)}/{version}.blob"


def manifest_name(arm: str, version: int) -> str:
    """``<arm>/<version>.manifest``, beside the version's blob."""
    return blob_name(arm, version).removesuffix(".blob") + ".manifest"


# Produced by BlobStore.listing(); consumed by recovery.py.
@dataclass(frozen=True)
class ArmFiles:
    """The version numbers an arm has files for in the store."""

    manifests: frozenset[int] = frozenset()
    blobs: frozenset[int] = frozenset()


def add_listed(found: dict[str, dict[str, set[int]]], name: str) -> None:
    """Note ``<arm>/<version>.(blob|manifest)`` in found; other names (temporary files) are ignored."""
    arm, _, file_name = name.partition("/")
    matched = _STORED_NAME.fullmatch(file_name)
    if _ARM.fullmatch(arm) and matched is not None:
        found.setdefault(arm, {"blob": set(), "manifest": set()})[matched.group(2)].add(
            int(matched.group(1))
        )


def arm_files(found: dict[str, dict[str, set[int]]]) -> dict[str, ArmFiles]:
    return {
        arm: ArmFiles(frozenset(kinds["manifest"]), frozenset(kinds["blob"]))
        for arm, kinds in sorted(found.items())
    }


def parse_blob_name(name: str, blob_uri: str) -> tuple[str, int]:
    """(arm, version) of a name made by blob_name; ValueError for anything else."""
    arm, _, file_name = name.partition("/")
    found = _BLOB_NAME.fullmatch(file_name)
    if not _ARM.fullmatch(arm) or found is None:
        raise ValueError(
            f"blob URI {blob_uri!r} does not name <arm>/<version>.blob inside the store"
        )
    return arm, int(found.group(1))


class BlobStore(ABC):
    """Blobs of weight versions, addressed by the URI that write() returns."""

    url: str
    """The store's own location (``file:///…`` or ``s3://bucket/prefix``), for logs."""

    unavailable: tuple[type[Exception], ...] = ()
    """Errors that mean the store cannot be reached right now (garbage collection
    tries again later); any other error is a bug or a misconfiguration."""

    @abstractmethod
    def write(self, arm: str, version: int, blob: bytes) -> str:
        """Store the blob durably (all or nothing for readers) and return its URI."""

    @abstractmethod
    def write_manifest(self, arm: str, version: int, manifest: bytes) -> None:
        """Store the version's serialized manifest beside its blob, durably and all or
        nothing for readers. Called after write() and before the registry commit."""

    @abstractmethod
    def read_manifest(self, arm: str, version: int) -> bytes:
        """The serialized manifest; FileNotFoundError if there is none."""

    @abstractmethod
    def listing(self) -> dict[str, ArmFiles]:
        """Every arm with files in the store, and the versions it has blobs and manifests of."""

    @abstractmethod
    def read(self, blob_uri: str, size: int) -> bytes:
        """The blob's bytes, when it is ``size`` bytes (its manifest's blob_size): checked
        before anything is read. FileNotFoundError if it is gone, BlobSizeMismatch if it is
        of another size."""

    @abstractmethod
    def exists(self, blob_uri: str) -> bool: ...

    @abstractmethod
    def delete(self, blob_uri: str) -> None:
        """Remove the blob and the manifest beside it (the manifest first, so a version
        is never listed with a manifest naming a blob that was deleted on purpose);
        files already gone are no error."""

    @abstractmethod
    def owns(self, blob_uri: str) -> bool:
        """Whether the URI names a blob of this store. The other methods raise
        ValueError for a URI that does not (another store's, or outside this one)."""


class LocalBlobStore(BlobStore):
    """Blobs in a local directory, written to a temporary file, fsynced and renamed
    into place. One server owns a directory."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()
        self.url = self.root.as_uri()

    def path(self, arm: str, version: int) -> Path:
        return self.root / blob_name(arm, version)

    def write(self, arm: str, version: int, blob: bytes) -> str:
        final = self.path(arm, version)
        write_durably(final, blob)
        return final.as_uri()

    def write_manifest(self, arm: str, version: int, manifest: bytes) -> None:
        write_durably(self.root / manifest_name(arm, version), manifest)

    def read_manifest(self, arm: str, version: int) -> bytes:
        path = self.root / manifest_name(arm, version)
        return _read_at_most(path, path.stat().st_size, MAX_MANIFEST_BYTES)

    def listing(self) -> dict[str, ArmFiles]:
        found: dict[str, dict[str, set[int]]] = {}
        if self.root.is_dir():
            for arm_dir in self.root.iterdir():
                if arm_dir.is_dir():
                    for file in arm_dir.iterdir():
                        add_listed(found, f"{arm_dir.name}/{file.name}")
        return arm_files(found)

    def read(self, blob_uri: str, size: int) -> bytes:
        path = self._local_path(blob_uri)
        check_size(blob_uri, path.stat().st_size, size)
        return _read_at_most(path, size, size)

    def exists(self, blob_uri: str) -> bool:
        return self._local_path(blob_uri).is_file()

    def delete(self, blob_uri: str) -> None:
        path = self._local_path(blob_uri)
        path.with_suffix(".manifest").unlink(missing_ok=True)
        path.unlink(missing_ok=True)

    def owns(self, blob_uri: str) -> bool:
        try:
            self._local_path(blob_uri)
        except ValueError:
            return False
        return True

    def _local_path(self, blob_uri: str) -> Path:
        parsed = urlparse(blob_uri)
        if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
            raise ValueError(f"blob URI {blob_uri!r} is not a local file:// URI")
        path = Path(unquote(parsed.path)).resolve()
        if not path.is_relative_to(self.root):
            raise ValueError(f"blob URI {blob_uri!r} points outside the store at {self.root}")
        parse_blob_name(path.relative_to(self.root).as_posix(), blob_uri)
        return path


def _read_at_most(path: Path, expected: int, bound: int) -> bytes:
    """``path``'s bytes, read only up to ``bound`` (+1, to see a file that grew since its
    stat); BlobSizeMismatch for a file over it or not ``expected`` bytes once read."""
    if expected > bound:
        raise BlobSizeMismatch(f"{path} is {expected:,} bytes, over the {bound:,} read")
    with path.open("rb") as f:
        data = f.read(bound + 1)
    check_size(path.as_uri(), len(data), expected)
    return data


def open_store(settings: WeightSyncSettings, stack: StackSettings) -> BlobStore:
    """The store that settings.blob_url names (already validated by the settings)."""
    if not settings.blob_url:
        return LocalBlobStore(stack.state_dir / "blobs")
    if settings.blob_url.startswith("file:"):
        return LocalBlobStore(local_directory(settings.blob_url))
    # Imported here so that the embedded stack, which never uses S3, does not load boto3.
    from rtrl.weight_sync.store_s3 import S3BlobStore

    return S3BlobStore.from_settings(settings)
