from __future__ import annotations

import os

# One OpenMP thread per process (subprocesses inherit it): on a small shared CI machine a second
# OpenMP thread per op makes the suite several times slower whenever another process is busy.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from pathlib import Path

import pytest

from tests.hf_models import hf_model, save_hf


@pytest.fixture(scope="session")
def mixtral_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Mixtral checkpoint written by transformers (per-expert layout)."""
    return save_hf(hf_model("mixtral"), tmp_path_factory.mktemp("ckpt") / "mixtral")


@pytest.fixture(autouse=True)
def _flowmoe_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """The built-in model is written once per test session into a private cache folder."""
    monkeypatch.setenv("FLOWMOE_HOME", str(tmp_path_factory.getbasetemp() / "flowmoe-home"))
