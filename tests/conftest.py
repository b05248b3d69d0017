from __future__ import annotations

import os
import signal
from collections.abc import Iterator

# One OpenMP thread per process (subprocesses inherit it): on a small shared CI machine a second
# OpenMP thread per op makes the suite several times slower whenever another process is busy.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from pathlib import Path

import pytest

from flowmoe.kernels import cpu_attention, cpu_expert
from tests.hf_models import hf_model, save_hf

# The tests send Ctrl-C as a user at a terminal would. A non-interactive shell starts a background job
# (`bash .ci/run &`, nohup) with SIGINT ignored, which every flowmoe process a test starts would inherit
# and keep (flowmoe keeps an ignored signal ignored): the tests start from Python's default instead.
_SESSION_HANDLERS = {
    signal.SIGINT: signal.default_int_handler,
    signal.SIGTERM: signal.getsignal(signal.SIGTERM),
}


@pytest.fixture(scope="session")
def mixtral_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Mixtral checkpoint written by transformers (per-expert layout)."""
    return save_hf(hf_model("mixtral"), tmp_path_factory.mktemp("ckpt") / "mixtral")


@pytest.fixture(autouse=True)
def _flowmoe_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """The built-in model is written once per test session into a private cache folder."""
    monkeypatch.setenv("FLOWMOE_HOME", str(tmp_path_factory.getbasetemp() / "flowmoe-home"))


@pytest.fixture(autouse=True)
def _cpu_isa() -> None:
    """The kernels' blocks (`cpu_expert.isa`, `cpu_attention.isa`: each worked out once) read afresh in
    each test, from its own FLOWMOE_CPU_ISA; a test that changes FLOWMOE_CPU_ISA midway clears them
    itself."""
    cpu_expert.isa.cache_clear()
    cpu_attention.isa.cache_clear()


@pytest.fixture(autouse=True)
def _signal_handlers() -> Iterator[None]:
    """Each test starts with `_SESSION_HANDLERS`: a handler something left behind (SIG_IGN above all)
    is inherited by every flowmoe process a later test starts, which then stays deaf to its Ctrl-C."""
    for signum, handler in _SESSION_HANDLERS.items():
        if handler is not None and signal.getsignal(signum) != handler:
            signal.signal(signum, handler)
    yield
