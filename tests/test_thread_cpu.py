"""Each thread's CPU time from /proc, grouped by name (flowmoe/core/thread_cpu.py): what bench/gpu.py
records per decode step so a GPU run shows which threads spend the host time."""

from __future__ import annotations

import threading
import time

import pytest

from flowmoe.core import thread_cpu
from flowmoe.core.thread_cpu import ThreadCpu, role, sample

pytestmark = pytest.mark.skipif(sample() is None, reason="no /proc/self/task on this system")


def spin(seconds: float) -> None:
    """Burn `seconds` of this thread's CPU."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def spin_then_idle(seconds: float, spent: threading.Event, stop: threading.Event) -> None:
    """Burn `seconds`, say so, then stay alive (idle) until `stop`."""
    spin(seconds)
    spent.set()
    stop.wait()


def test_a_named_thread_burning_cpu_is_its_own_group() -> None:
    cpu = ThreadCpu()
    for _ in range(2):
        cpu.start()
        spent, stop = threading.Event(), threading.Event()
        worker = threading.Thread(
            target=spin_then_idle, args=(0.05, spent, stop), name="flowmoe-cuda-gpu.compute"
        )
        worker.start()
        spin(0.02)
        assert spent.wait(30)
        cpu.stop()  # the worker still alive: a thread that exits inside an interval is not read
        stop.set()
        worker.join()
    record = cpu.per_step()
    seconds = record["thread_cpu_s_per_step"]
    assert record["steps"] == 2
    # two threads of that name, one per step, each started inside its interval: counted from zero
    assert record["threads_per_group"]["flowmoe-cuda-gpu.compute"] == 2
    assert seconds["flowmoe-cuda-gpu.compute"] == pytest.approx(0.05, abs=0.02)
    assert seconds["main"] == pytest.approx(0.02, abs=0.015)
    assert record["wall_s_per_step"] >= 0.05
    assert role("flowmoe-cuda-gpu.compute") == "lanes" and role("main") == "main"


def test_threads_python_did_not_start_are_named_by_their_kernel_name() -> None:
    now = sample()
    assert now is not None
    main = threading.main_thread().native_id
    assert main is not None and now.groups[main] == "main"
    assert role("native:cuda-EvtHandlr") == "other"
    assert thread_cpu.DIGITS.sub("#", "cuda00001400006") == "cuda#"


def test_clock_ticks_where_schedstat_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without schedstat a thread's time is utime + stime from stat, in clock ticks, the comm
    (which may hold spaces and parentheses) skipped."""
    stat = "42 (a (b) c) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 1 0"
    files = {"/proc/self/task/42/stat": stat}
    monkeypatch.setattr(thread_cpu, "read_small", files.get)
    assert thread_cpu.thread_seconds("42") == pytest.approx(300 * thread_cpu.TICK)
    assert thread_cpu.thread_seconds("43") is None  # a thread gone between the listing and the read


def test_nothing_measured_is_an_empty_record() -> None:
    cpu = ThreadCpu()
    cpu.stop()  # a stop without a start measures nothing
    assert cpu.per_step() == {}
