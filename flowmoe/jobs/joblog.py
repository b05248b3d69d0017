"""The output JSONL of a job: appended one whole line per finished request, resumable.

Opening a log takes an exclusive lock on it (a second job on the same file is
refused, naming the process that holds it), checks that every whole line is a
result flowmoe wrote, and only then cuts off a torn last line (a crash
mid-write), so re-running the same command continues the job and never
duplicates or corrupts a result, and a file flowmoe did not write is never
modified. A failed write (disk full, I/O error) is undone before it is
reported, so the log stays whole and resumable.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
from pathlib import Path
from typing import Any

from attrs import define, field

from flowmoe.core.errors import FlowmoeError
from flowmoe.jobs.batching import JobId

LINE_START = b'{"id": '  # every line `append` writes starts so (json.dumps keeps the key order)
RESULT_KEYS = {"id": (str, int), "output_ids": (list,), "finish_reason": (str,)}


@define
class JobLog:
    path: Path
    done: set[JobId] = field(factory=set)  # ids as given: 7 and "7" are different requests
    _fd: int | None = None
    _size: int = 0  # bytes of whole lines in the file
    _holder: Path | None = None  # the sidecar naming this process as the lock's holder

    @classmethod
    def open(cls, path: str | Path, prompts: str | Path | None = None) -> JobLog:
        """Lock, check and recover the log at `path` (created if missing); `prompts` is the job's
        prompt file, which the log must not be (by identity, whatever the spelling)."""
        log = cls(Path(path))
        if prompts is not None:
            _refuse_same_file(log.path, Path(prompts))
        log._fd = _open_for_append(log.path)
        try:
            log._lock()
            log._recover()
        except OSError as exc:  # an I/O error reading it, a file system without locks
            log.close()
            raise _cannot_use(log.path, exc) from exc
        except BaseException:
            log.close()
            raise
        return log

    def _lock(self) -> None:
        assert self._fd is not None
        _lock_or_refuse(self._fd, self.path)
        holder = holder_file(self.path)
        if not _sidecar_is_ours(holder):  # a file of that name flowmoe did not write stays as it is
            return
        try:  # who holds the lock, for the message of a second run; the lock works without it
            holder.write_text(f"{HOLDER_START}{os.getpid()} on host {socket.gethostname()}\n")
        except OSError:
            return
        self._holder = holder

    def _recover(self) -> None:
        """Read the ids done; every whole line must be a result before a torn tail is cut."""
        assert self._fd is not None
        data = _read_all(self._fd)
        self.done, self._size = _results(data, self.path)
        if self._size < len(data):  # the torn tail of an interrupted write: the request runs again
            os.ftruncate(self._fd, self._size)

    def append(self, record: dict[str, Any]) -> None:
        """Write one result as a single line with one write call, then flush it to disk; a failed
        write is cut off again, so the log keeps only whole lines."""
        assert self._fd is not None, "log is closed"
        assert next(iter(record)) == "id", "a result line starts with its id (LINE_START)"
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        try:
            written = os.write(self._fd, line)
            if written != len(line):
                raise OSError(errno.ENOSPC, f"short write, {written} of {len(line)} bytes")
            os.fsync(self._fd)
        except OSError as exc:
            self._undo()
            raise FlowmoeError(
                f"{self.path}: cannot write a result ({exc.strerror}); the {len(self.done)} results "
                "written so far are kept, re-run the same command to resume"
            ) from exc
        self._size += len(line)
        self.done.add(record["id"])

    def _undo(self) -> None:
        """Cut a partly written line (best effort: the next open cuts a torn tail anyway)."""
        assert self._fd is not None
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, self._size)

    def close(self) -> None:
        if self._holder is not None:  # still holding the lock: the sidecar is ours
            self._holder.unlink(missing_ok=True)
            self._holder = None
        if self._fd is not None:
            os.close(self._fd)  # releases the lock
            self._fd = None


def check_output(path: str | Path, prompts: str | Path) -> None:
    """The checks `JobLog.open` makes, without creating, locking or changing anything: a front end
    calls it to fail before it spends minutes loading a model."""
    path = Path(path)
    _refuse_same_file(path, Path(prompts))
    _check_folder(path)
    if not path.exists():
        return
    if path.is_dir():
        raise _cannot_open(path, os.strerror(errno.EISDIR))
    try:  # for writing, as the run will (and as an NFS lock needs), but nothing is written
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        raise _cannot_open(path, exc.strerror) from exc
    try:
        _lock_or_refuse(fd, path)
        _results(_read_all(fd), path)
    except OSError as exc:
        raise _cannot_use(path, exc) from exc
    finally:
        os.close(fd)  # and the lock with it


HOLDER_START = "pid "  # how the sidecar a run writes begins


def holder_file(path: Path) -> Path:
    """The sidecar where the lock's holder writes its pid and host."""
    return path.with_name(f".{path.name}.lock")


def _sidecar_is_ours(holder: Path) -> bool:
    """Missing, or a plain file an earlier flowmoe run wrote (a run killed before it could remove it)."""
    if holder.is_symlink():
        return False
    try:
        with holder.open("rb") as handle:
            return handle.read(len(HOLDER_START)) == HOLDER_START.encode()
    except FileNotFoundError:
        return True
    except OSError:
        return False


def _holder_of(path: Path) -> str:
    holder = holder_file(path)
    if holder.is_symlink():
        return "holder unknown"
    try:
        text = holder.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return "holder unknown"
    return text if text.startswith(HOLDER_START) else "holder unknown"


def _refuse_same_file(output: Path, prompts: Path) -> None:
    try:
        same = os.path.samefile(output, prompts)
    except OSError:  # one of them does not exist (yet): not the same file
        return
    if same:
        raise FlowmoeError(
            f"--output {output} is the prompt file {prompts}; results must go to a file of their own"
        )


def _check_folder(path: Path) -> None:
    if not path.parent.is_dir():
        raise FlowmoeError(f"--output {path}: folder {path.parent} does not exist; create it first")


def _cannot_open(path: Path, why: str | None) -> FlowmoeError:
    return FlowmoeError(f"--output {path}: cannot open for writing ({why})")


def _cannot_use(path: Path, exc: OSError) -> FlowmoeError:
    return FlowmoeError(f"--output {path}: cannot read or lock it ({exc.strerror or exc})")


def _lock_or_refuse(fd: int, path: Path) -> None:
    """Lock the log exclusively, or say which process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        raise FlowmoeError(
            f"{path}: another flowmoe run is writing this file ({_holder_of(path)}); "
            "wait for it to finish or choose another --output"
        ) from exc


def _open_for_append(path: Path) -> int:
    """The log's descriptor (read and append), creating the file; the folder must exist."""
    _check_folder(path)
    created = not path.exists()
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as exc:
        raise _cannot_open(path, exc.strerror) from exc
    if created:  # make the new file's name durable too
        _fsync_folder(path.parent)
    return fd


def _fsync_folder(folder: Path) -> None:
    """Best effort: some file systems cannot sync a folder, and the file's data is synced anyway."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _read_all(fd: int) -> bytes:
    chunks, offset = [], 0
    while chunk := os.pread(fd, 1 << 20, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _results(data: bytes, path: Path) -> tuple[set[JobId], int]:
    """The ids of a log's results and the length of its whole lines; an error unless every whole
    line is a result flowmoe wrote and what follows the last one is the start of another."""
    whole = data[: data.rfind(b"\n") + 1]
    lines = whole.split(b"\n")[:-1]
    done = {_result_id(line, f"{path}:{number}") for number, line in enumerate(lines, start=1)}
    tail = data[len(whole) :]
    if tail and not (tail.startswith(LINE_START) or LINE_START.startswith(tail)):
        raise _not_a_log(f"{path}:{len(lines) + 1}", "its last line is not the start of a result")
    return done, len(whole)


def _result_id(line: bytes, where: str) -> JobId:
    """The id of one existing output line, which must be a result flowmoe wrote."""
    try:
        row = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise _not_a_log(where, "not a JSON result line") from exc
    if not isinstance(row, dict):
        raise _not_a_log(where, f"a JSON {type(row).__name__}, not a result object")
    for key, types in RESULT_KEYS.items():
        value = row.get(key)
        if not isinstance(value, types) or isinstance(value, bool):
            raise _not_a_log(where, f'"{key}" is {json.dumps(value)[:40]}')
    return row["id"]


def _not_a_log(where: str, why: str) -> FlowmoeError:
    return FlowmoeError(
        f"{where}: existing file is not a flowmoe results log ({why}); it is left as it is, "
        "choose another --output"
    )
