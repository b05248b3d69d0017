"""The thread plan: the host's cores split between the threads that compute, never oversubscribed.

A torch op on the CPU runs on the thread that calls it plus an OpenMP team of that thread's own,
sized by that thread's intra-op setting (torch.set_num_threads applies to the calling thread; a
thread that never set it takes the last value any thread set). Two lane threads that each
compute with every core put twice as many busy threads as cores on the machine, and OpenMP's
waiting workers spin on cores the other team needs: the same small job then takes anywhere from
0.4 to 41 s on a busy 2-core machine (issue 15).

The plan gives `compute_threads` host threads that may compute at the same time `intra_op` torch
threads each, so that compute_threads × intra_op ≤ the budget ≤ the cores this process may use
(os.sched_getaffinity). The budget is --cpu-threads; by default OMP_NUM_THREADS when set, otherwise
the usable cores that are free when the run starts (`free_cores`), at most the usable cores. `reserve`
cores are kept for threads that launch work but compute little (the event loop and the CUDA launch
threads when a GPU computes; they run with one intra-op thread each), as long as the budget leaves
at least one core to compute with.

Why free cores (issue 25): an OpenMP team waits at the end of each parallel region for its slowest
thread, and a thread that shares its core with another busy process runs only in that process's
gaps, so every region (flowmoe's steps run many short ones) waits for a scheduler slice. With one
busy co-tenant on a 2-core machine the README tour's cgopipe job took 6.3-17.3 s on both cores and
0.21 s on one. A short look at /proc/stat (which cores sat idle over `SAMPLE_S`) sizes the default
team to the cores nobody else is using; 1 where every core is busy.

A co-tenant that comes after the start: a team of several threads looks at /proc/stat again every
WATCH_S seconds of its run (`CoTenants`, asked by devices/inline.py) and narrows to the cores other
processes leave free, widening again once they are.

How the runtime uses it (devices/factory.py): without CUDA every lane's nodes run on the event
loop's thread, one compute thread with the whole budget, exactly as a plain eager step; with CUDA
the host lanes (cpu.compute) get the budget less one core, which the loop and launch threads keep.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

from attrs import frozen

from flowmoe.core.errors import ConfigError


@frozen
class ThreadPlan:
    cores: int  # usable by this process
    budget: int  # threads the plan may keep busy (--cpu-threads; default: cores)
    compute_threads: int  # host threads that compute at the same time
    intra_op: int  # torch intra-op threads of each compute thread

    @property
    def busy(self) -> int:
        """Threads computing at once at most (≤ budget ≤ cores)."""
        return self.compute_threads * self.intra_op


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # a platform without affinity (macOS)
        return os.cpu_count() or 1


PROC_STAT = Path("/proc/stat")
SAMPLE_S = 0.1  # seconds of /proc/stat looked at: 10 ticks per core at Linux's usual USER_HZ of 100
FREE = 0.75  # idle share over the sample for a core to count as free (a busy co-tenant leaves ~0)


def _cpu_times(text: str) -> dict[int, tuple[int, int]]:
    """(idle + iowait, total) jiffies of each core, from /proc/stat's text."""
    times = {}
    for line in text.splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit():
            ticks = [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
            times[int(name[3:])] = (ticks[3] + ticks[4], sum(ticks))
    return times


def _ticks(before: str, after: str, cores: set[int]) -> list[tuple[int, int]]:
    """(idle, total) jiffies each of `cores` (those in both readings, in order) counted between two
    readings of /proc/stat."""
    start, end = _cpu_times(before), _cpu_times(after)
    ticks = []
    for core in sorted(cores & start.keys() & end.keys()):
        (idle_0, total_0), (idle_1, total_1) = start[core], end[core]
        ticks.append((idle_1 - idle_0, total_1 - total_0))
    return ticks


def idle_shares(before: str, after: str, cores: set[int]) -> list[float]:
    """The share of the time each of `cores` sat idle between two readings of /proc/stat."""
    return [idle / total if total > 0 else 1.0 for idle, total in _ticks(before, after, cores)]


def count_free(shares: list[float]) -> int:
    """Cores at least FREE idle, at least 1."""
    return max(1, sum(share >= FREE for share in shares))


SPIN = 30_000  # GOMP_SPINCOUNT on a free machine: ~0.3 ms by libgomp's own estimate (~100,000 a ms)


def omp_waits() -> None:
    """How OpenMP's idle workers wait between parallel regions, unless the user chose (OMP_WAIT_POLICY
    or GOMP_SPINCOUNT set). libgomp reads both once, when torch loads it, so this runs before torch is
    imported (the CLI's first step). A decode step runs dozens of short regions with Python between
    them, 2-vCPU AMD EPYC, bf16 batch 1 at 2 threads, medians of 6 (bench/RESULTS.md, issue 25):
    - every usable core free when the run starts: a short spin, GOMP_SPINCOUNT=SPIN. Idle, ~35 ms a
      step, as OMP_WAIT_POLICY=ACTIVE's ~38; passive workers woken by the kernel for each region ~42,
      barely under 1 thread's ~48. A co-tenant that comes later shrinks the team (`CoTenants`): with
      one, the spinning 2-thread step took ~175 ms, passive ~50, 1 thread ~47.
    - a core busy at the start: OMP_WAIT_POLICY=PASSIVE, workers that sleep at once (the default
      plan computes on the free cores anyway; an explicit --cpu-threads no slower than 1 thread)."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    if free_cores() < usable_cores():
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    else:
        os.environ["GOMP_SPINCOUNT"] = str(SPIN)


STAT_BOUND = 1 << 20  # bytes of /proc/stat read at most (a line per core: ~100 bytes each)


def read_stat() -> str:
    """/proc/stat's text, up to STAT_BOUND bytes (OSError where it cannot be read)."""
    with PROC_STAT.open("rb") as stat:
        return stat.read(STAT_BOUND).decode("ascii", errors="replace")


@functools.cache
def free_cores() -> int:
    """The usable cores no other process kept busy over a short look at /proc/stat (once per
    process; at least 1); all usable cores where /proc/stat cannot be read."""
    try:
        cores = os.sched_getaffinity(0)
        before = read_stat()
        time.sleep(SAMPLE_S)
        after = read_stat()
    except (AttributeError, OSError):
        return usable_cores()
    return count_free(idle_shares(before, after, cores))


WATCH_S = 1.0  # seconds of a run between two looks at the co-tenants
TICK_S = 1 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01  # a /proc/stat jiffy


def busy_seconds(before: str, after: str, cores: set[int]) -> float:
    """CPU seconds `cores` spent busy (not idle or iowait) between two readings of /proc/stat."""
    return sum(total - idle for idle, total in _ticks(before, after, cores)) * TICK_S


def team_beside(others: float, widest: int, cores: int) -> int:
    """The team's width when other processes keep `others` cores' worth busy: the cores they leave
    at least FREE idle, at least 1 and at most `widest`."""
    return max(1, min(widest, int(cores - others + (1 - FREE))))


class CoTenants:
    """How wide a run's team may be now (issue 25): every WATCH_S seconds of a run, the busy time of
    the usable cores in /proc/stat less this process's own CPU time is what other processes ran;
    the team keeps to the cores they leave free, since each parallel region waits for its slowest
    thread. Asked at each run of the inline queue (devices/inline.py); one look costs ~30 us."""

    def __init__(self, widest: int) -> None:
        self.widest = widest
        self.team = widest
        try:
            self._cores = os.sched_getaffinity(0)
        except (AttributeError, OSError):  # no affinity (macOS): no /proc/stat either
            self._cores = set()
        self._last: tuple[float, str, float] | None = None  # monotonic s, /proc/stat, process CPU s

    def width(self, now: float) -> int:
        if not self._cores or (self._last is not None and now - self._last[0] < WATCH_S):
            return self.team
        try:
            stat = read_stat()
        except OSError:
            self._cores = set()
            return self.team
        own = time.process_time()
        if self._last is not None:
            then, before, own_before = self._last
            others = busy_seconds(before, stat, self._cores) - (own - own_before)
            self.team = team_beside(others / (now - then), self.widest, len(self._cores))
        self._last = (now, stat, own)
        return self.team


def plan_threads(
    cores: int,
    budget: int | None = None,
    compute_threads: int = 1,
    reserve: int = 0,
    default: int | None = None,
) -> ThreadPlan:
    """Split `budget` threads over `compute_threads` host threads, keeping `reserve` cores for
    non-computing threads when at least one core is left to compute with. A budget outside
    [1, cores] is refused: more would oversubscribe the cores. Without a budget: `default` (the
    process's torch threads) up to `cores`, or all `cores`."""
    if cores < 1 or compute_threads < 1 or reserve < 0:
        raise ValueError(f"cores {cores}, compute threads {compute_threads}, reserve {reserve}")
    if budget is None:
        budget = max(1, min(default or cores, cores))
    if not 1 <= budget <= cores:
        raise ConfigError(
            f"--cpu-threads {budget}: must be in [1, {cores}], the cores this process may use "
            "(os.sched_getaffinity); more threads than cores only oversubscribe them"
        )
    computing = budget - reserve if budget > reserve else budget
    threads = min(compute_threads, computing)
    return ThreadPlan(cores, budget, threads, computing // threads)
