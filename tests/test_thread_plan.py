"""The default thread plan on a busy machine (issue 25): the cores other processes keep busy are not
counted, so no OpenMP thread of a run waits on a core it shares with a co-tenant; OMP_NUM_THREADS and
--cpu-threads still decide where given."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch

import flowmoe.core.threads as threads
import flowmoe.devices.factory as factory
from flowmoe.core.plan import Lane, Op, TaskNode
from flowmoe.core.threads import (
    FREE,
    PROC_STAT,
    SPIN,
    TICK_S,
    CoTenants,
    busy_seconds,
    count_free,
    free_cores,
    idle_shares,
    omp_waits,
    team_beside,
    usable_cores,
)
from flowmoe.devices.inline import InlineWorker
from flowmoe.devices.threadpool import set_intra_op


def stat(*cores: tuple[int, int]) -> str:
    """/proc/stat's text with each core's (busy, idle) jiffies (user and idle columns)."""
    lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
    lines += [f"cpu{n} {busy} 0 0 {idle} 0 0 0 0 0 0" for n, (busy, idle) in enumerate(cores)]
    return "\n".join([*lines, "intr 12345", "ctxt 678"]) + "\n"


def test_idle_shares_are_read_per_core_from_proc_stat() -> None:
    before = stat((100, 900), (500, 500), (0, 0))
    after = stat((110, 990), (600, 500), (0, 0))  # cpu0 90% idle, cpu1 busy, cpu2 did not tick
    assert idle_shares(before, after, {0, 1, 2}) == [0.9, 0.0, 1.0]
    assert idle_shares(before, after, {1, 7}) == [0.0]  # a core not in /proc/stat is left out


@pytest.mark.parametrize(
    ("shares", "free"),
    [([1.0, 1.0], 2), ([1.0, 0.02], 1), ([0.0, 0.0], 1), ([FREE, FREE - 0.01, 0.5], 1), ([0.9] * 4, 4)],
)
def test_a_core_counts_as_free_when_mostly_idle_and_a_run_gets_at_least_one(
    shares: list[float], free: int
) -> None:
    assert count_free(shares) == free


@pytest.fixture
def _unset_omp(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The suite sets OMP_NUM_THREADS=1 (tests/conftest.py); these tests want the default path."""
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS")
    set_intra_op(usable_cores())
    yield
    set_intra_op(before)


@pytest.mark.usefixtures("_unset_omp")
def test_the_default_plan_takes_the_free_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setattr(factory, "free_cores", lambda: 1)
    assert factory.host_plan(cpu).intra_op == 1
    assert factory.host_plan(cpu, usable_cores()).intra_op == usable_cores()  # --cpu-threads decides
    monkeypatch.setattr(factory, "free_cores", lambda: usable_cores())
    assert factory.host_plan(cpu).intra_op == usable_cores()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the environment decides where it is set
    set_intra_op(1)
    assert factory.host_plan(cpu).intra_op == 1


@pytest.mark.skipif(not PROC_STAT.exists() or usable_cores() < 2, reason="needs /proc/stat and 2 cores")
def test_a_core_a_busy_process_runs_on_is_not_free() -> None:
    """A spinning process pinned to one of this process's cores: that core never sits idle while it
    can run, so at most the others count (other load on the machine only lowers the count)."""
    core = sorted(os.sched_getaffinity(0))[0]
    spin = subprocess.Popen(
        [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile 1: pass"]
    )
    try:
        time.sleep(0.5)  # it has started spinning
        assert free_cores.__wrapped__() <= usable_cores() - 1
    finally:
        spin.kill()
        spin.wait()


def test_busy_seconds_count_the_cores_non_idle_ticks() -> None:
    before = stat((100, 900), (500, 500))
    after = stat((150, 950), (600, 500))  # cpu0 50 busy ticks of 100, cpu1 100 of 100
    assert busy_seconds(before, after, {0, 1}) == pytest.approx(150 * TICK_S)
    assert busy_seconds(before, after, {1, 9}) == pytest.approx(100 * TICK_S)


@pytest.mark.parametrize(
    ("others", "widest", "cores", "team"),
    [
        (0.0, 2, 2, 2),
        (0.2, 2, 2, 2),
        (0.3, 2, 2, 1),
        (0.95, 2, 2, 1),
        (2.0, 2, 2, 1),
        (1.0, 4, 8, 4),
        (5.0, 4, 8, 3),
    ],
)
def test_the_team_keeps_to_the_cores_co_tenants_leave(
    others: float, widest: int, cores: int, team: int
) -> None:
    assert team_beside(others, widest, cores) == team


def test_a_watched_team_narrows_while_a_co_tenant_runs_and_widens_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each look compares /proc/stat with the last one; between looks the width is kept."""
    readings = iter([stat((0, 0), (0, 0)), stat((100, 0), (5, 95)), stat((110, 90), (15, 185))])
    own = iter([0.0, 0.05, 0.25])  # this process: 0.05 s in the first second, 0.2 s in the next
    monkeypatch.setattr(threads, "read_stat", lambda: next(readings))
    monkeypatch.setattr(threads.time, "process_time", lambda: next(own))
    monkeypatch.setattr(threads, "TICK_S", 0.01)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    watch = CoTenants(2)
    assert watch.width(10.0) == 2  # the first look: nothing to compare yet
    assert watch.width(10.5) == 2  # within WATCH_S: not looked at
    assert watch.width(11.0) == 1  # 1.05 s busy, 0.05 of it ours: a co-tenant holds a core
    assert watch.width(12.0) == 2  # 0.2 s busy, all ours


@pytest.mark.parametrize(
    ("free", "env"), [(2, {"GOMP_SPINCOUNT": str(SPIN)}), (1, {"OMP_WAIT_POLICY": "PASSIVE"})]
)
def test_workers_spin_briefly_on_a_free_machine_and_sleep_on_a_busy_one(
    monkeypatch: pytest.MonkeyPatch, free: int, env: dict[str, str]
) -> None:
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):  # set first, so that the test's end restores them
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(threads, "free_cores", lambda: free)
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    omp_waits()
    assert {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ} == env
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's choice stays
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    omp_waits()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE" and "GOMP_SPINCOUNT" not in os.environ


def test_the_inline_worker_counts_its_queue_runs_by_team_width() -> None:
    """A run asked for 2 threads whose co-tenants narrowed it to 1 for a while says so: each queue run
    is counted under the width it ran with (bench/vs_llamacpp.py shows the share beside its rows)."""

    class Widths:
        def __init__(self) -> None:
            self.seen = iter([2, 1, 1, 2])
            self.team = 2

        def width(self, now: float) -> int:
            self.team = next(self.seen)
            return self.team

    worker = InlineWorker(2)
    worker._tenants = Widths()
    previous = torch.get_num_threads()

    async def run() -> None:
        for n in range(4):
            done = asyncio.get_running_loop().create_future()
            node = TaskNode(n, Op.GATE, Lane.CPU_COMPUTE, layer=0, mb=0)
            worker.start(node, lambda: None, lambda *args, done=done: done.set_result(args))
            await done

    try:
        asyncio.run(run())
    finally:
        torch.set_num_threads(previous)
    assert worker.team_runs == {2: 2, 1: 2}
