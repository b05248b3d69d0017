"""bench/gpu.py's per-thread table: the CPU seconds per decode step of each thread group of the
process (a row's "thread_cpu" record, flowmoe/core/thread_cpu.py), split into the event loop's
thread, flowmoe's lane threads and the threads flowmoe does not run (torch's pools, the CUDA driver)."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from flowmoe.core.thread_cpu import role

TOP = 3  # groups named in the "busiest other threads" column


def split(record: dict[str, Any]) -> dict[str, float]:
    """A record's CPU seconds per step by role ("main", "lanes", "other") and what no live thread
    holds ("exited": the process's time less every thread's, threads that ended inside a step)."""
    by_role = dict.fromkeys(("main", "lanes", "other"), 0.0)
    for group, seconds in record["thread_cpu_s_per_step"].items():
        by_role[role(group)] += seconds
    by_role["exited"] = record["process_cpu_s_per_step"] - sum(by_role.values())
    return by_role


def others(record: dict[str, Any], top: int = TOP) -> str:
    """The busiest groups outside main and the lanes: "name seconds (threads)", largest first."""
    groups = record["threads_per_group"]
    seconds = [(g, s) for g, s in record["thread_cpu_s_per_step"].items() if role(g) == "other"]
    seconds.sort(key=lambda item: -item[1])
    return ", ".join(f"{g} {s:.3f} ({groups[g]})" for g, s in seconds[:top])


def thread_table(rows: list[dict[str, Any]], title: str) -> Table:
    """One line per measured row: process CPU and wall per decode step, main / lanes / other / exited."""
    table = Table(title=f"CPU s per decode step by thread — {title}")
    for column in ("budget", "scheduler", "wall s", "process CPU s", "main", "lanes", "other", "exited",
                   "busiest other threads (threads)"):  # fmt: skip
        table.add_column(column, justify="right")
    for r in rows:
        record = r.get("thread_cpu") or {}
        if r.get("status") != "ok" or not record:
            continue
        parts = split(record)
        times = (record["wall_s_per_step"], record["process_cpu_s_per_step"],
                 *(parts[k] for k in ("main", "lanes", "other", "exited")))  # fmt: skip
        table.add_row(r["budget"], r["scheduler"], *(f"{t:.3f}" for t in times), others(record))
    return table
