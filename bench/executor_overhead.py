"""The executor's own cost per node: 100k no-op nodes through the dataflow executor.

Three DAG shapes (lane-local chains, a pipeline whose every edge crosses lanes,
and a schedule-like mix) on four workers (inline: the executor alone; threads:
one host thread per lane, as CPU runs use; runtime: the same threads as the
runtime configures them, profiler ranges on and a span callback; sim: the
virtual clock), on uvloop and on asyncio's default loop. Prints a rich table,
writes bench/executor_overhead.json.

    python bench/executor_overhead.py [--nodes 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch
import uvloop
from rich.console import Console
from rich.table import Table

from flowmoe.core.executor import Executor, Span
from flowmoe.core.plan import Lane, Op, TaskNode
from flowmoe.devices.inline import InlineWorker
from flowmoe.devices.sim import SimWorker, run_virtual
from flowmoe.devices.threadpool import ThreadPoolWorker

LANES = (Lane.GPU_COMPUTE, Lane.GPU_H2D, Lane.GPU_D2H, Lane.CPU_COMPUTE)


def lane_chains(n: int) -> list[TaskNode]:
    """Each lane a chain of its own: nodes never wait on another lane."""
    return [TaskNode(i, Op.GATE, LANES[i % 4], deps=(i - 4,) if i >= 4 else ()) for i in range(n)]


def crossing(n: int) -> list[TaskNode]:
    """One chain hopping lanes at every edge: the worst case, every node waits on another lane."""
    return [TaskNode(i, Op.GATE, LANES[i % 4], deps=(i - 1,) if i else ()) for i in range(n)]


def schedule_like(n: int) -> list[TaskNode]:
    """Mostly gpu.compute with copies and CPU work beside it; deps on a few recent nodes."""
    rng = random.Random(0)
    nodes = []
    for i in range(n):
        lane = rng.choices(LANES, weights=(6, 2, 1, 2))[0]
        deps = tuple(sorted({i - rng.randint(1, 8) for _ in range(rng.randint(0, 2))} - set(range(-8, 0))))
        nodes.append(TaskNode(i, Op.GATE, lane, deps=deps))
    return nodes


RUNS = (
    ("inline", "uvloop"),
    ("inline", "asyncio"),
    ("threads", "uvloop"),
    ("runtime", "uvloop"),
    ("sim", "virtual"),
)
SHAPES: dict[str, Callable[[int], list[TaskNode]]] = {
    "lane chains": lane_chains,
    "crossing": crossing,
    "schedule-like": schedule_like,
}


def sample(span: Span) -> None:
    """What the runtime's span callback does for a node that changes no memory counter."""
    if span.node.op in (Op.PAGE_COPY, Op.EVICT, Op.EMBED):
        raise AssertionError("the benchmark's nodes are gates")


async def run(
    nodes: list[TaskNode], worker, clock: Callable[[], float] = time.perf_counter, on_span=None
) -> float:
    executor = Executor(dict.fromkeys(Lane, worker), on_span=on_span, clock=clock)
    started = time.perf_counter()
    for node in nodes:
        executor.submit(node)
    await executor.drain()
    return time.perf_counter() - started


def measure(shape: str, worker: str, loop: str, n: int) -> float:
    nodes = SHAPES[shape](n)
    if worker == "sim":

        async def simulated() -> float:
            return await run(nodes, SimWorker(lambda _n: 1e-6), asyncio.get_running_loop().time)

        return run_virtual(simulated()) / n
    make = {
        "inline": InlineWorker,
        "threads": lambda: ThreadPoolWorker(profile_ranges=False),
        "runtime": ThreadPoolWorker,
    }[worker]
    instance = make()
    try:
        runner = uvloop.run if loop == "uvloop" else asyncio.run
        return runner(run(nodes, instance, on_span=sample if worker == "runtime" else None)) / n
    finally:
        instance.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=100_000)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("executor_overhead.json"))
    args = parser.parse_args()
    rows = []
    for shape in SHAPES:
        for worker, loop in RUNS:
            seconds = measure(shape, worker, loop, args.nodes)
            rows.append({"shape": shape, "worker": worker, "loop": loop, "us_per_node": seconds * 1e6})
    table = Table(title=f"executor overhead, {args.nodes} no-op nodes ({platform.machine()})")
    for column in ("DAG shape", "worker", "loop", "µs / node"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(row["shape"], row["worker"], row["loop"], f"{row['us_per_node']:.1f}")
    Console().print(table)
    meta = {"nodes": args.nodes, "cpus": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
