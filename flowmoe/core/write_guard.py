"""Every file flowmoe writes passes one guard, so that no path given to it can destroy a user's file.

A command's outputs are refused, with one line naming the flag, the path and the reason, and the
file at the path is left byte for byte as it was, when the path

- is not a regular file (a directory, a FIFO, a device node, a socket), whatever the flags;
- is a file the command reads (the prompt file, a checkpoint's file, a profile) or another output
  of the same command, compared by identity (device and inode, symlinks followed, so a hard
  link, a symlink and every spelling count) and, for a file not there yet, by its resolved path;
- is an existing file that flowmoe did not write, unless the command is given `--force`: each
  kind of file flowmoe writes carries a marker (`OutputKind`) by which it knows its own.

A file is written whole or not at all: into a temporary file beside it (beside the file a symlink
points to, so the link stays), then renamed over it. The target is checked again just before the
rename, since a run may take hours.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from attrs import frozen

from flowmoe.core.bounded_read import not_regular, open_regular
from flowmoe.core.errors import FlowmoeError
from flowmoe.core.os_errors import os_reason

PEEK = 64 * 2**10  # bytes read at each end of an existing file to find its marker


@frozen
class OutputKind:
    """A kind of file flowmoe writes and the marker it writes into each one."""

    name: str  # in words, for the error line: "Chrome trace"
    marker: bytes
    at_start: bool = True  # the file starts with the marker; else it is in its first or last PEEK bytes

    def marks(self, head: bytes, tail: bytes) -> bool:
        if self.at_start:
            return head.startswith(self.marker)
        return self.marker in head or self.marker in tail


@frozen
class Named:
    """A file a command reads, in words: ("the prompt file", path)."""

    role: str
    path: Path


@frozen
class Target:
    """An output of a command: its flag, its path, and its kind (None: a file the command appends
    to, whose content its writer checks, as the results log)."""

    flag: str
    path: Path
    kind: OutputKind | None

    @property
    def label(self) -> str:
        """The output as its error lines name it: `--trace run.json`."""
        return f"{self.flag} {self.path}" if self.flag else str(self.path)


@frozen
class Guard:
    """What a command reads, what it writes, and whether it may replace files flowmoe did not write."""

    reads: tuple[Named, ...] = ()
    targets: tuple[Target, ...] = ()
    force: bool = False

    def check_all(self) -> None:
        """Every output, before the command's work starts (a wrong path fails in a second)."""
        for target in self.targets:
            self._check(target)

    def check(self, path: Path, kind: OutputKind | None) -> None:
        """One error line if writing `path` could destroy a file; nothing is created or changed."""
        self._check(self._target(path, kind))

    def _check(self, target: Target) -> None:
        path, kind, label = target.path, target.kind, target.label
        try:
            found = _stat(path, label)
            if found is not None and (why := not_regular(found.st_mode)) is not None:
                raise FlowmoeError(f"{label}: {why}; flowmoe writes only regular files")
            if not os.path.isdir(os.path.dirname(os.path.realpath(path)) or "."):
                folder = Path(path).parent
                raise FlowmoeError(f"{label}: folder {folder} does not exist; create it first")
            self._refuse_same(target, label)
            if found is not None and kind is not None and not self.force and not _ours(path, found, kind):
                raise FlowmoeError(
                    f"{label}: the existing file is not a {kind.name} flowmoe wrote; it is left as it "
                    "is: choose another path, or pass --force to replace it"
                )
        except OSError as exc:
            raise FlowmoeError(f"{label}: {os_reason(exc)}") from exc

    def write(self, path: Path, kind: OutputKind, produce: Callable[[Path], None]) -> Path:
        """Write `path` whole through `produce(temporary path)`, once the guard allows it; a file
        system error (no space, read-only, permission) is one error line naming the flag."""
        target = self._target(path, kind)
        self._check(target)
        real = Path(os.path.realpath(path))
        try:
            fd, name = tempfile.mkstemp(prefix=".flowmoe-", suffix=real.suffix, dir=real.parent)
        except OSError as exc:
            raise FlowmoeError(f"{target.label}: {os_reason(exc)}") from exc
        tmp = Path(name)
        try:
            os.fchmod(fd, 0o666 & ~current_umask())  # mkstemp's 0600 -> what any other output gets
            os.close(fd)
            produce(tmp)
            self._check(target)
            os.replace(tmp, real)
        except BaseException as exc:
            tmp.unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise FlowmoeError(f"{target.label}: {os_reason(exc)}") from exc
            raise
        return Path(path)

    def _target(self, path: Path, kind: OutputKind | None) -> Target:
        """`path` as the command's output of that path (its flag names it in errors)."""
        return Target(next((t.flag for t in self.targets if t.path == path), ""), path, kind)

    def _refuse_same(self, target: Target, label: str) -> None:
        outputs = (Named(f"the {t.flag} file", t.path) for t in self.targets if t.flag != target.flag)
        others = [*self.reads, *outputs]
        mine = _identity(target.path)
        for other in others:
            if _identity(other.path) == mine:
                raise FlowmoeError(
                    f"{label}: is {other.role} ({other.path}); an output needs a file of its own"
                )


DEFAULT_GUARD = Guard()  # reads nothing, writes one file: refuses non-regular and foreign files


def _stat(path: Path, label: str) -> os.stat_result | None:
    """The file at `path` (symlinks followed), None when there is none; a dangling link is refused."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise FlowmoeError(f"{label}: a symlink to a missing file; name the file itself") from None
        return None


def _identity(path: Path) -> tuple[int, int] | str:
    """(device, inode) of an existing file; where a missing one would be, resolved."""
    try:
        found = os.stat(path)
    except OSError:
        return os.path.realpath(path)
    return (found.st_dev, found.st_ino)


def _ours(path: Path, found: os.stat_result, kind: OutputKind) -> bool:
    """An empty file, or one that carries the kind's marker."""
    if found.st_size == 0:
        return True
    with open_regular(path, FlowmoeError) as handle:
        head = os.pread(handle.fileno(), PEEK, 0)
        tail = os.pread(handle.fileno(), PEEK, max(0, found.st_size - PEEK))
    return kind.marks(head, tail)


def current_umask() -> int:
    """The process's umask, read without changing it where Linux shows it (/proc/self/status)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o077)  # elsewhere: set and restore (briefly the strictest mask, never a looser one)
    os.umask(umask)
    return umask
