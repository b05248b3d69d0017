"""Rows of a checkpoint's table read from the file (model/file_rows.py): the stored bits, an id out
of range refused as F.embedding refuses it, a file cut short after loading named."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from flowmoe.core.errors import CheckpointError
from flowmoe.model.file_rows import FileRows


def _table(tmp_path: Path, dtype: torch.dtype) -> tuple[Path, torch.Tensor, int]:
    table = torch.randn(40, 24).to(dtype)  # [rows, cols]
    path, offset = tmp_path / "shard.bin", 136  # the table after a header
    path.write_bytes(b"h" * offset + table.view(torch.uint8).numpy().tobytes() + b"tail")
    return path, table, offset


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_the_stored_bits(tmp_path: Path, dtype: torch.dtype) -> None:
    path, table, offset = _table(tmp_path, dtype)
    rows = FileRows(path, offset, (40, 24), dtype)
    empty = torch.tensor([], dtype=torch.long)
    for ids in (torch.tensor([0, 39, 7, 7]), torch.tensor([3]), torch.arange(40), empty):
        out = rows(ids)
        assert out.dtype == dtype and out.shape == (ids.shape[0], 24) and torch.equal(out, table[ids])


def test_an_id_outside_the_table_is_refused(tmp_path: Path) -> None:
    path, _, offset = _table(tmp_path, torch.float32)
    rows = FileRows(path, offset, (40, 24), torch.float32)
    for bad in (40, -1):
        with pytest.raises(IndexError, match=f"token id {bad} is outside the embedding's 40 rows"):
            rows(torch.tensor([1, bad]))


def test_a_file_cut_short_after_loading_is_named(tmp_path: Path) -> None:
    path, _, offset = _table(tmp_path, torch.float32)
    rows = FileRows(path, offset, (40, 24), torch.float32)
    assert rows(torch.tensor([39])).shape == (1, 24)  # opened while whole
    with path.open("r+b") as file:
        file.truncate(offset + 30 * 24 * 4 + 10)
    rows(torch.tensor([29]))  # rows before the cut still read
    with pytest.raises(CheckpointError, match=r"shard\.bin: embedding row 30 is cut short"):
        rows(torch.tensor([30]))


def test_a_file_gone_before_the_first_read_is_named(tmp_path: Path) -> None:
    path, _, offset = _table(tmp_path, torch.float32)
    rows = FileRows(path, offset, (40, 24), torch.float32)
    path.unlink()
    with pytest.raises(CheckpointError, match=r"shard\.bin: reopening for the embedding's rows"):
        rows(torch.tensor([0]))


def test_the_file_is_closed_with_the_reader(tmp_path: Path) -> None:
    path, _, offset = _table(tmp_path, torch.float32)
    rows = FileRows(path, offset, (40, 24), torch.float32)
    rows(torch.tensor([0]))
    fd = rows._fd
    assert fd is not None and os.readlink(f"/proc/self/fd/{fd}") == str(path)
    del rows
    gc.collect()
    assert not os.path.exists(f"/proc/self/fd/{fd}") or os.readlink(f"/proc/self/fd/{fd}") != str(path)
