"""Fixtures shared by the bad-input tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from flowmoe.model.builtin import ensure_builtin


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A checkpoint folder of the built-in model, tmp_path/model: its small files copied, its shard
    linked (the tests replace or point at its files; none writes through the link)."""
    folder = tmp_path / "model"
    folder.mkdir()
    for file in ensure_builtin().iterdir():
        if file.suffix == ".safetensors":
            (folder / file.name).symlink_to(file)
        else:
            shutil.copy(file, folder / file.name)
    return folder
