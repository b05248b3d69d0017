"""The output JSONL of a job: appended one whole line per finished request, resumable.

Opening a log takes an exclusive lock on it (a second job on the same file is
refused, naming the process that holds it), checks that every whole line is a
result flowmoe wrote, and only then cuts off a torn last line (a crash
mid-write), so re-running the same command continues the job and never
duplicates or corrupts a result, and a file flowmoe did not write is never
modified. A last line that is not something flowmoe half-wrote is never cut. A
failed write (disk full, I/O error) is undone before it is reported, so the log
stays whole and resumable.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import socket
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from attrs import define, field, frozen

from flowmoe.core.bounded_read import SIDECAR
from flowmoe.core.errors import FlowmoeError
from flowmoe.core.write_guard import Guard, Named, Target
from flowmoe.jobs.batching import JobId

LINE_START = b'{"id": '  # every line `append` writes starts so (json.dumps keeps the key order)


@frozen
class LogLayout:
    """What every line of a results log holds: its keys' JSON types, and which key is the request's
    id (a resume skips the requests whose ids the log holds)."""

    name: str  # as the refusal of a file that is not such a log names it
    keys: Mapping[str, tuple[type, ...]]
    request_id: str


RESULTS = LogLayout(
    "flowmoe results log", {"id": (str, int), "output_ids": (list,), "finish_reason": (str,)}, "id"
)
LINE_BOUND = 64 * 2**20  # the longest line a results log may hold (a result is far shorter)
HOLDER_START = "pid "  # how the sidecar a run writes begins
HOLDER_LINE = re.compile(rb"pid \d+ on host [^\n]*\n")  # the whole of a sidecar a run wrote


@define
class JobLog:
    path: Path
    layout: LogLayout = RESULTS
    done: set[JobId] = field(factory=set)  # ids as given: 7 and "7" are different requests
    _fd: int | None = None
    _size: int = 0  # bytes of whole lines in the file
    _holder: Path | None = None  # the sidecar naming this process as the lock's holder
    _holder_line: bytes = b""  # what this process wrote there: the sidecar is removed only if it holds it

    @classmethod
    def open(
        cls,
        path: str | Path,
        prompts: str | Path | None = None,
        guard: Guard | None = None,
        layout: LogLayout = RESULTS,
    ) -> JobLog:
        """Lock, check and recover the log at `path` (created if missing), whose lines hold
        `layout`. The write guard refuses a path that is not a regular file or is a file the job
        reads: `prompts` (the job's prompt file), or whatever a front end's `guard` names."""
        log = cls(Path(path), layout)
        (guard or output_guard(log.path, prompts)).check(log.path, None)
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
        line = f"{HOLDER_START}{os.getpid()} on host {socket.gethostname()}\n".encode()
        if _claim_sidecar(holder, line):  # who holds the lock, for a second run's message
            self._holder, self._holder_line = holder, line

    def _recover(self) -> None:
        """Read the ids done; every whole line must be a result before a torn tail is cut."""
        assert self._fd is not None
        self.done, self._size, complete = _results(self._fd, self.path, self.layout)
        if complete:  # a whole result that lacks only its newline: completed, not cut
            os.write(self._fd, b"\n")
            self._size = os.fstat(self._fd).st_size
        elif self._size < os.fstat(self._fd).st_size:  # a line flowmoe half-wrote: its request runs again
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
        self.done.add(record[self.layout.request_id])

    def _undo(self) -> None:
        """Cut a partly written line (best effort: the next open cuts a torn tail anyway)."""
        assert self._fd is not None
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, self._size)

    def close(self) -> None:
        if self._holder is not None:  # still holding the lock: the sidecar is ours, if it is still there
            if _sidecar_holds(self._holder, self._holder_line):
                self._holder.unlink(missing_ok=True)
            self._holder = None
        if self._fd is not None:
            os.close(self._fd)  # releases the lock
            self._fd = None


def output_guard(path: Path, prompts: str | Path | None) -> Guard:
    """The write guard of a log whose job reads only its prompt file."""
    reads = (Named("the prompt file", Path(prompts)),) if prompts is not None else ()
    return Guard(reads, (Target("--output", path, None),))


def check_output(path: str | Path, guard: Guard, layout: LogLayout = RESULTS) -> None:
    """The checks `JobLog.open` makes, without creating, locking or changing anything: a front end
    calls it to fail before it spends minutes loading a model."""
    path = Path(path)
    guard.check(path, None)
    if not path.exists():
        return
    try:  # for writing, as the run will (and as an NFS lock needs), but nothing is written
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise _cannot_open(path, exc.strerror) from exc
    try:
        _check_regular(fd, path)
        _lock_or_refuse(fd, path)
        _results(fd, path, layout)
    except OSError as exc:
        raise _cannot_use(path, exc) from exc
    finally:
        os.close(fd)  # and the lock with it


def holder_file(path: Path) -> Path:
    """The sidecar where the lock's holder writes its pid and host."""
    return path.with_name(f".{path.name}.lock")


def _claim_sidecar(holder: Path, line: bytes) -> bool:
    """Write `line` into the sidecar if it is missing or one an earlier run left (a run killed
    before it could remove it): a plain file, linked nowhere else, holding one holder line and no
    more. Anything else of that name (a file of the user's, a link, a FIFO) is left as it is."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(holder, flags, 0o644)
    except OSError:  # a symlink, a folder, a file system that refuses it: the lock works without it
        return False
    try:
        if _sidecar_line(fd) is None:
            return False
        os.ftruncate(fd, 0)
        os.pwrite(fd, line, 0)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def _sidecar_line(fd: int) -> bytes | None:
    """The holder line of an open sidecar a run wrote (b"" when empty), None for any other file."""
    found = os.fstat(fd)
    if not stat.S_ISREG(found.st_mode) or found.st_nlink != 1 or found.st_size > SIDECAR.limit:
        return None
    line = os.pread(fd, SIDECAR.limit, 0)
    return line if not line or HOLDER_LINE.fullmatch(line) else None


def _read_sidecar(holder: Path) -> bytes | None:
    """The holder line of the sidecar at `holder`, read without following a link or waiting on a FIFO
    (None: it cannot be read, or holds no holder line)."""
    try:
        fd = os.open(holder, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return _sidecar_line(fd)
    except OSError:
        return None
    finally:
        os.close(fd)


def _sidecar_holds(holder: Path, line: bytes) -> bool:
    """The sidecar is still the one this process wrote (not a file put in its place since)."""
    return _read_sidecar(holder) == line


def _holder_of(path: Path) -> str:
    """The holder line of a sidecar a run wrote, for the refusal that names it."""
    line = _read_sidecar(holder_file(path))
    return line.decode(errors="replace").strip() if line else "holder unknown"


def _cannot_open(path: Path, why: str | None) -> FlowmoeError:
    return FlowmoeError(f"--output {path}: cannot open for writing ({why})")


def _cannot_use(path: Path, exc: OSError) -> FlowmoeError:
    return FlowmoeError(f"--output {path}: cannot read or lock it ({exc.strerror or exc})")


def _check_regular(fd: int, path: Path) -> None:
    """The opened file is still a regular one (not swapped for a FIFO or a device since the guard)."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise _cannot_open(path, "not a regular file")


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
    """The log's descriptor (read and append), creating the file; the guard has checked the path."""
    created = not path.exists()
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise _cannot_open(path, exc.strerror) from exc
    try:
        _check_regular(fd, path)
    except FlowmoeError:
        os.close(fd)
        raise
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


def _lines(fd: int, path: Path, layout: LogLayout) -> Iterator[bytes]:
    """The file's lines with their newlines, read in blocks (the last one may lack its newline);
    a line longer than LINE_BOUND is no result flowmoe wrote."""
    pending, offset = bytearray(), 0
    while chunk := os.pread(fd, 1 << 20, offset):
        offset += len(chunk)
        pending += chunk
        start = 0
        while (end := pending.find(b"\n", start)) >= 0:
            yield bytes(pending[start : end + 1])
            start = end + 1
        del pending[:start]
        if len(pending) > LINE_BOUND:
            raise _not_a_log(f"{path}", layout, f"a line longer than {LINE_BOUND // 2**20} MiB")
    if pending:
        yield bytes(pending)


def _results(fd: int, path: Path, layout: LogLayout) -> tuple[set[JobId], int, bool]:
    """The ids of a log's results, the length of its whole lines, and whether its last line is a
    whole result that lacks only its newline; an error unless every whole line is a result flowmoe
    wrote and what follows the last one is a result or flowmoe's own half-written line."""
    done: set[JobId] = set()
    size, number = 0, 0
    for number, line in enumerate(_lines(fd, path, layout), start=1):
        if not line.endswith(b"\n"):
            if _torn(line):
                return done, size, False
            done.add(_result_id(line, f"{path}:{number}", layout, last=True))
            return done, size, True
        done.add(_result_id(line, f"{path}:{number}", layout))
        size += len(line)
    return done, size, False


def _torn(tail: bytes) -> bool:
    """A last line that a write flowmoe began and a crash cut short: the start of a result line
    and not a whole JSON value (that is a line of its own, flowmoe's or not, and is never cut)."""
    if LINE_START.startswith(tail):
        return True
    if not tail.startswith(LINE_START):
        return False
    try:
        text = tail.decode("utf-8")
    except UnicodeDecodeError as exc:  # a cut may split the last character, and only that one
        if exc.reason != "unexpected end of data":
            return False
        text = tail[: exc.start].decode("utf-8", errors="replace")
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:  # cut short: inside a string, or where more was due
        if exc.msg.startswith("Unterminated string"):
            return True
        if exc.msg.startswith("Invalid \\uXXXX escape"):
            return exc.pos >= len(text) - len("\\u0000")
        return exc.msg.startswith("Expecting") and exc.pos >= len(text) - len("fals")  # "fals": a cut literal
    except (ValueError, RecursionError):
        return False
    return False


def _result_id(line: bytes, where: str, layout: LogLayout, last: bool = False) -> JobId:
    """The request id of one existing output line, which must be a line of `layout` flowmoe wrote."""
    try:
        row = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        why = "its last line is neither a result nor the start of one" if last else "not a JSON result line"
        raise _not_a_log(where, layout, why) from exc
    if not isinstance(row, dict):
        raise _not_a_log(where, layout, f"a JSON {type(row).__name__}, not a result object")
    for key, types in layout.keys.items():
        value = row.get(key)
        if not isinstance(value, types) or isinstance(value, bool):
            raise _not_a_log(where, layout, f'"{key}" is {json.dumps(value)[:40]}')
    return row[layout.request_id]


def _not_a_log(where: str, layout: LogLayout, why: str) -> FlowmoeError:
    return FlowmoeError(
        f"{where}: existing file is not a {layout.name} ({why}); it is left as it is, choose another --output"
    )
