"""The CPU time of each thread of this process, read from /proc (Linux), grouped by thread name.

A run's host time per step (`time.process_time()`, the trace's `host_seconds`) sums every thread of
the process: the event loop's, flowmoe's lane threads (named `flowmoe-cuda-<lane>`, `flowmoe-<lane>`),
and threads flowmoe never names: torch's intra-op (OpenMP) pool, the CUDA driver's, any library's.
`sample()` reads each thread's CPU seconds so a caller can difference two samples taken around the
steps it measures (`ThreadCpu`, per step) and see which threads spent the host time.

Per thread: /proc/self/task/<tid>/schedstat's first field (nanoseconds on the CPU) where the kernel
provides it, else utime + stime from /proc/self/task/<tid>/stat (clock ticks). Each file is read up
to READ_BYTES and at most MAX_THREADS threads are read; a thread that exits between the listing and
its read is skipped. A thread's group is its Python name where Python started it (the main thread:
"main"), else `native:` and its kernel name (/proc's comm) with digit runs folded to `#`, so a pool's
workers share a group.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Mapping
from typing import Any

from attrs import define, field, frozen

TASKS = "/proc/self/task"
READ_BYTES = 4096  # a stat line is ~300 bytes, schedstat ~40, comm <= 16
MAX_THREADS = 4096
TICK = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
DIGITS = re.compile(r"\d+")


def read_small(path: str) -> str | None:
    """The text of the /proc file at `path` (at most READ_BYTES), None if it is gone or unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, READ_BYTES).decode("ascii", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def thread_seconds(tid: str) -> float | None:
    """Thread `tid`'s CPU seconds: schedstat's run time (ns) where present, else utime + stime."""
    sched = read_small(f"{TASKS}/{tid}/schedstat")
    if sched:
        return int(sched.split()[0]) / 1e9
    stat = read_small(f"{TASKS}/{tid}/stat")
    if not stat or ")" not in stat:
        return None
    rest = stat.rsplit(")", 1)[1].split()  # after the comm, which may hold spaces: state is rest[0]
    return (int(rest[11]) + int(rest[12])) * TICK  # utime, stime: fields 14 and 15 of stat


def group_of(tid: int, python_names: Mapping[int, str]) -> str:
    """The group thread `tid` is counted in: its Python name, or its kernel name, digits folded."""
    name = python_names.get(tid)
    if name is not None:
        return name
    comm = (read_small(f"{TASKS}/{tid}/comm") or "?").strip()
    return "native:" + DIGITS.sub("#", comm)


def python_names() -> dict[int, str]:
    """Native thread id -> Python thread name, the main thread as "main"."""
    main = threading.main_thread()
    return {t.native_id: ("main" if t is main else t.name) for t in threading.enumerate() if t.native_id}


@frozen
class Sample:
    """Each thread's CPU seconds at one moment (thread id -> seconds) and its group."""

    seconds: Mapping[int, float]
    groups: Mapping[int, str]


def sample() -> Sample | None:
    """Every thread's CPU seconds now (at most MAX_THREADS), None where /proc has no task list."""
    try:
        tids = os.listdir(TASKS)[:MAX_THREADS]
    except OSError:
        return None
    names = python_names()
    seconds: dict[int, float] = {}
    groups: dict[int, str] = {}
    for tid in tids:
        value = thread_seconds(tid)
        if value is not None:
            seconds[int(tid)] = value
            groups[int(tid)] = group_of(int(tid), names)
    return Sample(seconds, groups)


@define
class ThreadCpu:
    """CPU seconds by thread group summed over the intervals `start()` .. `stop()` (the steps
    measured); `per_step()` divides by their count. Threads started inside an interval count from
    zero; threads that exit inside one are lost (the process's own CPU time tells how much)."""

    seconds: dict[str, float] = field(factory=dict)
    threads: dict[str, set[int]] = field(factory=dict)
    process_seconds: float = 0.0
    wall_seconds: float = 0.0
    intervals: int = 0
    _before: Sample | None = None
    _process: float = 0.0
    _wall: float = 0.0

    def start(self) -> None:
        self._before = sample()
        self._process = time.process_time()
        self._wall = time.perf_counter()

    def stop(self) -> None:
        before, after = self._before, sample()
        if before is None or after is None:
            return
        self.process_seconds += time.process_time() - self._process
        self.wall_seconds += time.perf_counter() - self._wall
        self.intervals += 1
        for tid, value in after.seconds.items():
            group = after.groups[tid]
            self.seconds[group] = self.seconds.get(group, 0.0) + value - before.seconds.get(tid, 0.0)
            self.threads.setdefault(group, set()).add(tid)
        self._before = None

    def per_step(self) -> dict[str, Any]:
        """The record: CPU seconds per interval by group (largest first), threads per group, the
        process's CPU seconds and the wall seconds per interval; empty where nothing was measured."""
        if not self.intervals:
            return {}
        n = self.intervals
        order = sorted(self.seconds, key=lambda g: -self.seconds[g])
        return {
            "thread_cpu_s_per_step": {g: self.seconds[g] / n for g in order},
            "threads_per_group": {g: len(self.threads[g]) for g in order},
            "process_cpu_s_per_step": self.process_seconds / n,
            "wall_s_per_step": self.wall_seconds / n,
            "steps": n,
        }


def role(group: str) -> str:
    """The group's role: "main" (the event loop's thread), "lanes" (flowmoe's lane threads) or
    "other" (threads flowmoe does not run: torch's pools, the CUDA driver's, any library's)."""
    if group == "main":
        return "main"
    return "lanes" if group.startswith("flowmoe") else "other"
