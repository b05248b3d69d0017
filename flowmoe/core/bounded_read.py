"""Every file flowmoe reads is opened here: a regular file, opened without blocking, read up to a
bound that fits its kind.

A path that names a FIFO, a device, a socket or a folder is refused before it is opened (a FIFO
would block the open or the read forever, /dev/zero would fill memory); the open itself uses
O_NONBLOCK and the descriptor is checked again, so a file swapped for a FIFO in between cannot
hang the run either. A file larger than its kind's bound is refused before it is read, with one
line naming it and the bound.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from attrs import frozen

from flowmoe.core.errors import ConfigError, FlowmoeError
from flowmoe.core.os_errors import os_reason

MiB = 2**20


@frozen
class Bound:
    """The most bytes a kind of file may hold, and the kind in words for the error line."""

    kind: str
    limit: int

    def __str__(self) -> str:
        return f"{self.limit // MiB} MiB" if self.limit >= MiB else f"{self.limit} bytes"


CONFIG = Bound("a JSON settings file", 16 * MiB)  # config.json, tokenizer_config.json, profiles
TEMPLATE = Bound("a chat template", 16 * MiB)
INDEX = Bound("a safetensors index", 64 * MiB)
TOKENIZER = Bound("a tokenizer", 256 * MiB)
ROUTING = Bound("a routing trace", 1024 * MiB)
TRACE = Bound("a Chrome trace", 2048 * MiB)
SIDECAR = Bound("a lock sidecar", 4096)

_NOT_REGULAR = (
    (stat.S_ISDIR, "is a directory, not a file"),
    (stat.S_ISFIFO, "is a FIFO (named pipe), not a regular file"),
    (stat.S_ISSOCK, "is a socket, not a regular file"),
    (stat.S_ISCHR, "is a device, not a regular file"),
    (stat.S_ISBLK, "is a device, not a regular file"),
)


def not_regular(mode: int) -> str | None:
    """Why a file of this mode is not one flowmoe reads or writes (None: a regular file)."""
    if stat.S_ISREG(mode):
        return None
    return next((why for test, why in _NOT_REGULAR if test(mode)), "is not a regular file")


def open_regular(path: Path, error: type[FlowmoeError] = ConfigError) -> BinaryIO:
    """The regular file at `path` (symlinks followed) open for reading as bytes, or one error line
    naming it."""
    try:
        why = not_regular(os.stat(path).st_mode)
        if why is not None:
            raise error(f"{path}: {why}")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise error(f"{path}: {os_reason(exc)}") from exc
    why = not_regular(os.fstat(fd).st_mode)  # it may have been swapped since the stat
    if why is not None:
        os.close(fd)
        raise error(f"{path}: {why}")
    return os.fdopen(fd, "rb")


def read_bounded(path: Path, bound: Bound = CONFIG, error: type[FlowmoeError] = ConfigError) -> bytes:
    """The bytes of the regular file at `path`, refused when it holds more than `bound`."""
    with open_regular(path, error) as handle:
        size = os.fstat(handle.fileno()).st_size
        if size > bound.limit:
            raise _too_large(path, bound, error)
        try:
            data = handle.read(bound.limit + 1)
        except OSError as exc:
            raise error(f"{path}: {os_reason(exc)}") from exc
    if len(data) > bound.limit:  # it grew since the fstat
        raise _too_large(path, bound, error)
    return data


def _too_large(path: Path, bound: Bound, error: type[FlowmoeError]) -> FlowmoeError:
    return error(f"{path}: larger than {bound} (the most {bound.kind} may hold); not read")
