"""The trajectory store: where a finished job's token arrays live, out of Redis.

Redis keeps a job's state and a small summary of its result; the payload (token ids, loss
mask, logprobs, per-turn records, messages) is one file per attempt, an Arrow IPC file of
one row in the columns of prorl_farm/columns.py.

:class:`TrajectoryStore` is the interface (an object store can implement it);
:class:`DirectoryStore` keeps files under a directory, node-local under ``prorl-farm up``
and on a shared filesystem on a cluster: ``<root>/b-<batch>/<job>.<token>.arrow``. A file
is written under a temporary name, flushed to disk and renamed into place, so a reader
never sees a partial payload and a crash mid-write leaves only a temporary file (swept
later); the attempt's token in the name keeps a re-queued attempt apart from an earlier one.
A store belongs to one farm (one Redis): its sweeps delete the payloads of batches that
farm no longer knows.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa

from prorl_farm.columns import PAYLOAD_KEYS, payload_table
from prorl_farm.errors import FarmError

SUFFIX = ".arrow"
TMP_PREFIX = ".tmp-"
# A temporary file this old belongs to a writer that died mid-write.
TMP_MAX_AGE_S = 3600.0


class StorageError(FarmError, OSError):
    """The trajectory store could not take or give back a payload (disk full, not
    writable, gone)."""


def has_payload(output) -> bool:
    """Whether a stage's output is a trajectory whose arrays go to the store."""
    return isinstance(output, dict) and "response_ids" in output and "prompt_ids" in output


def split_payload(result: dict) -> tuple[dict, dict]:
    """(summary for Redis, payload for the store) of a stage output with a trajectory."""
    summary = {k: v for k, v in result.items() if k not in PAYLOAD_KEYS}
    payload = {k: result[k] for k in PAYLOAD_KEYS if k in result}
    summary["prompt_len"] = len(result["prompt_ids"])
    summary["response_len"] = len(result["response_ids"])
    summary["num_turns"] = len(result.get("turns") or ())
    return summary, payload


class TrajectoryStore:
    """Where payloads live. ``ref``: what a job's summary keeps to find its payload."""

    def put(self, batch_id: str, job_id: str, token: str, payload: dict) -> dict:
        """Write durably; returns the ref ({"path", "bytes"}). Raises StorageError."""
        raise NotImplementedError

    def read_table(self, ref: dict) -> pa.Table | None:
        """The payload's one-row table, or None when it is gone (acknowledged, expired)."""
        raise NotImplementedError

    def delete_batch(self, batch_id: str) -> tuple[int, int]:
        """Delete a batch's payloads; returns (files, bytes) deleted."""
        raise NotImplementedError

    def batches(self) -> list[str]:
        """Batches with payloads stored."""
        raise NotImplementedError

    def sweep_temporary(self, max_age_s: float = TMP_MAX_AGE_S) -> int:
        """Remove what writers that died mid-write left; returns how many."""
        return 0

    def usage(self) -> dict:
        """{"free_bytes", "total_bytes"} of the medium, where known."""
        return {}


def open_store(settings) -> TrajectoryStore:
    """The trajectory store the settings name."""
    return DirectoryStore(settings.trajectory_dir, settings.store_min_free_mb << 20)


def _dir_name(batch_id: str) -> str:
    return f"b-{batch_id}"  # never "." or "..", whatever the batch id


class DirectoryStore(TrajectoryStore):
    """Payload files under ``root``, written atomically (temporary file, fsync, rename)."""

    def __init__(self, root: str | os.PathLike, min_free_bytes: int = 0):
        self.root = Path(root)
        self.min_free_bytes = min_free_bytes

    def _ensure_root(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError(f"trajectory store {self.root}: {e.strerror or e}") from e

    def put(self, batch_id: str, job_id: str, token: str, payload: dict) -> dict:
        self._ensure_root()
        free = self.usage().get("free_bytes")
        if free is not None and free < self.min_free_bytes:
            raise StorageError(f"trajectory store {self.root}: {free} bytes free, below the "
                               f"{self.min_free_bytes} kept free (PRORL_STORE_MIN_FREE_MB)")
        table = payload_table(payload)
        rel = f"{_dir_name(batch_id)}/{job_id}.{token}{SUFFIX}"
        final = self.root / rel
        tmp = final.parent / f"{TMP_PREFIX}{job_id}.{token}.{uuid.uuid4().hex[:8]}"
        try:
            final.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                with pa.ipc.new_file(f, table.schema) as writer:
                    writer.write_table(table)
                f.flush()
                os.fsync(f.fileno())
                size = f.tell()
            os.replace(tmp, final)
            dir_fd = os.open(final.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as e:
            try:
                tmp.unlink()
            except OSError:
                pass
            what = "disk full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
            raise StorageError(f"trajectory store {self.root}: writing {rel}: {what}") from e
        return {"path": rel, "bytes": size}

    def _path(self, ref: dict) -> Path:
        rel = Path(ref["path"])
        if rel.is_absolute() or ".." in rel.parts or len(rel.parts) != 2:
            raise StorageError(f"not a payload path: {ref['path']!r}")
        return self.root / rel

    def read_table(self, ref: dict) -> pa.Table | None:
        path = self._path(ref)
        try:
            with pa.memory_map(str(path), "r") as source:
                return pa.ipc.open_file(source).read_all()
        except FileNotFoundError:
            return None
        except (OSError, pa.ArrowInvalid) as e:
            raise StorageError(f"trajectory store: reading {ref['path']}: {e}") from e

    def delete_batch(self, batch_id: str) -> tuple[int, int]:
        path = self.root / _dir_name(batch_id)
        files = size = 0
        for entry in _scan(path):
            if entry.name.endswith(SUFFIX):
                files += 1
                size += entry.stat().st_size
        shutil.rmtree(path, ignore_errors=True)
        return files, size

    def batches(self) -> list[str]:
        try:
            return [e.name[2:] for e in os.scandir(self.root)
                    if e.is_dir() and e.name.startswith("b-")]
        except FileNotFoundError:
            return []

    def sweep_temporary(self, max_age_s: float = TMP_MAX_AGE_S) -> int:
        cutoff, n = time.time() - max_age_s, 0
        for batch_id in self.batches():
            for entry in _scan(self.root / _dir_name(batch_id)):
                if entry.name.startswith(TMP_PREFIX):
                    try:
                        if entry.stat().st_mtime < cutoff:
                            os.unlink(entry.path)
                            n += 1
                    except FileNotFoundError:
                        pass
        return n

    def usage(self) -> dict:
        try:
            disk = shutil.disk_usage(self.root)
        except OSError:
            return {}
        return {"free_bytes": disk.free, "total_bytes": disk.total}


def _scan(path: Path) -> Iterable[os.DirEntry]:
    try:
        return list(os.scandir(path))
    except FileNotFoundError:
        return []
