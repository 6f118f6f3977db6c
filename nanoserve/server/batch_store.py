"""Where the Batch API keeps its state: uploaded files, batch records and per-batch results,
as plain files under one directory, written so that a crash (even SIGKILL) never leaves a
half-written object behind.

    STATE_DIR/files/file-<id>.json          a file's FileObject (metadata)
    STATE_DIR/files/file-<id>.data          its bytes, exactly as uploaded (or generated)
    STATE_DIR/batches/batch_<id>.json       a batch's Batch object
    STATE_DIR/batches/batch_<id>.results    one line per finished request, appended as it finishes

Whole objects (metadata, records, file bytes) are written to a temporary file in the same
directory, fsynced and renamed over the old one (`os.replace`, atomic on POSIX): a reader sees
the old version or the new one. A results log is the one file that grows in place: each line is
one request's output line, exactly as it will appear in the batch's output or error file, written
with a single write, flushed and fsynced before the request counts as done. A kill can tear only
the last line; `ResultLog.open` drops it (and truncates the file to the last whole line), so that
request simply runs again.

Ids sort by creation time (`<kind>-<hex time_ns><random>`), so listings keep their order across
restarts.
"""
from __future__ import annotations

import json
import os
import secrets
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def new_id(prefix: str) -> str:
    """`prefix` + a hex id that sorts by creation time: file-…, batch_…, batch_req_…"""
    return f"{prefix}{time.time_ns():016x}{secrets.token_hex(8)}"


def derived_id(prefix: str, *parts: str) -> str:
    """A deterministic id, so that redoing a step after a crash names the same object."""
    return prefix + uuid.uuid5(uuid.NAMESPACE_URL, "/".join(parts)).hex


def atomic_write(path: Path, data: bytes) -> None:
    """Replace `path` by `data` all at once: temp file in the same directory, fsync, rename."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with _ignore_missing():
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write(path, json.dumps(obj, indent=1).encode())


def _fsync_dir(directory: Path) -> None:
    """Make a rename durable (the directory entry itself), where the platform allows it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _ignore_missing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> bool:
        return kind is not None and issubclass(kind, FileNotFoundError)


class ResultLog:
    """A batch's finished requests: custom_id -> its output line (bytes, no newline), in the
    order they finished. Appends are durable one line at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines: dict[str, bytes] = {}
        self._file: Any = None

    @classmethod
    def open(cls, path: Path) -> ResultLog:
        """Read what a previous run wrote: whole lines are kept (the first one per custom_id);
        a torn last line (no newline, or not JSON) is dropped and cut off the file."""
        log = cls(path)
        data = path.read_bytes() if path.exists() else b""
        good = 0  # bytes of whole, valid lines
        while good < len(data):
            end = data.find(b"\n", good)
            if end < 0:
                break  # torn by a kill mid-write
            line = data[good:end]
            try:
                custom_id = json.loads(line)["custom_id"]
            except (ValueError, KeyError, TypeError):
                break  # also torn (a partial line that happens to end in a newline byte)
            log.lines.setdefault(custom_id, line)
            good = end + 1
        if good != len(data):
            with open(path, "r+b") as f:
                f.truncate(good)
                os.fsync(f.fileno())
        return log

    def append(self, custom_id: str, line: bytes) -> None:
        """Record one finished request. Once this returns, it survives a kill."""
        if custom_id in self.lines:  # exactly once, even if asked twice
            return
        if self._file is None:
            self._file = open(self.path, "ab")
        self._file.write(line + b"\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.lines[custom_id] = line

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class BatchStore:
    """Files and batch records on disk, mirrored in memory (both are small)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.files_dir = self.root / "files"
        self.batches_dir = self.root / "batches"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.batches_dir.mkdir(parents=True, exist_ok=True)
        self.files: dict[str, dict] = {}
        for meta in sorted(self.files_dir.glob("file-*.json")):
            obj = _read_json(meta)
            if obj is not None and (self.files_dir / f"{obj['id']}.data").exists():
                self.files[obj["id"]] = obj

    # -- files -------------------------------------------------------------------------------
    def add_file(self, data: bytes, filename: str, purpose: str, file_id: str | None = None) -> dict:
        """Store bytes as a file: the bytes first, then the metadata that makes them visible."""
        file_id = file_id or new_id("file-")
        obj = {"id": file_id, "object": "file", "bytes": len(data), "created_at": int(time.time()),
               "filename": filename, "purpose": purpose, "status": "processed", "expires_at": None,
               "status_details": None}
        atomic_write(self.files_dir / f"{file_id}.data", data)
        atomic_write_json(self.files_dir / f"{file_id}.json", obj)
        self.files[file_id] = obj
        return obj

    def file_content(self, file_id: str) -> bytes:
        return (self.files_dir / f"{file_id}.data").read_bytes()

    def delete_file(self, file_id: str) -> None:
        self.files.pop(file_id, None)
        with _ignore_missing():
            os.unlink(self.files_dir / f"{file_id}.json")  # invisible from here on
        with _ignore_missing():
            os.unlink(self.files_dir / f"{file_id}.data")

    # -- batches -----------------------------------------------------------------------------
    def save_batch(self, record: dict) -> None:
        atomic_write_json(self.batches_dir / f"{record['id']}.json", record)

    def load_batches(self) -> Iterator[dict]:
        for path in sorted(self.batches_dir.glob("batch_*.json")):
            record = _read_json(path)
            if record is not None:
                yield record

    def results_path(self, batch_id: str) -> Path:
        return self.batches_dir / f"{batch_id}.results"

    def results(self, batch_id: str) -> ResultLog:
        return ResultLog.open(self.results_path(batch_id))


def _read_json(path: Path) -> dict | None:
    try:
        obj = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None  # only atomic writes land here, so this is a foreign or damaged file
    return obj if isinstance(obj, dict) and isinstance(obj.get("id"), str) else None
