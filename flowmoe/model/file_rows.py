"""Rows of a matrix stored in a checkpoint shard, read from the file with pread.

An untied embedding stays in its shard (model/arena.py `top_arena`): a step needs only its tokens'
rows. Read through the shard's mapping, each row faulted in maps ~16 pages around it, which the
reader must then let go again (madvise), ~45 us a decode step's row on the 2-vCPU Zen 4 of issue
25; a pread of the row's bytes into the step's buffer takes ~3 us and maps nothing, so the table
never enters the resident set."""

from __future__ import annotations

import os
import weakref
from pathlib import Path

import torch

from flowmoe.core.errors import CheckpointError
from flowmoe.core.os_errors import os_reason


class FileRows:
    """Rows of a row-major [rows, cols] tensor of `dtype` whose bytes start at `offset` in `path`.
    The file is opened on the first read and closed with this object."""

    def __init__(self, path: Path, offset: int, shape: tuple[int, int], dtype: torch.dtype) -> None:
        self.path, self.offset, self.shape, self.dtype = path, offset, shape, dtype
        self.row_bytes = shape[1] * dtype.itemsize
        self._fd: int | None = None

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] int64 -> the rows [T, cols], as stored. An id outside the table raises IndexError
        (as F.embedding); a file shorter than it was when loaded, CheckpointError."""
        rows = self.shape[0]
        out = torch.empty(ids.shape[0], self.shape[1], dtype=self.dtype)  # [T, cols]
        raw = out.view(torch.uint8).numpy()  # [T, row_bytes]: each row's bytes land in place
        fd = self._open()
        for i, row in enumerate(ids.tolist()):
            if not 0 <= row < rows:
                raise IndexError(f"token id {row} is outside the embedding's {rows} rows")
            try:
                got = os.preadv(fd, [raw[i]], self.offset + row * self.row_bytes)
            except OSError as exc:
                raise CheckpointError(f"{self.path}: reading embedding row {row}: {os_reason(exc)}") from exc
            if got != self.row_bytes:
                raise CheckpointError(
                    f"{self.path}: embedding row {row} is cut short (the file changed after loading)"
                )
        return out

    def _open(self) -> int:
        if self._fd is None:
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                reason = os_reason(exc)
                raise CheckpointError(f"{self.path}: reopening for the embedding's rows: {reason}") from exc
            self._fd = fd
            weakref.finalize(self, os.close, fd)  # closed with this object, or at exit
        return self._fd
