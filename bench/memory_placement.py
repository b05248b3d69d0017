"""The read rate a decode step gets from the memory it is given (issue 25). On a VM the host decides
where each guest page lies and what else reads its memory, so the same build's buffers can be read at
rates far apart from one process or minute to the next; a memory-bound 2-thread decode step follows
them.

Each of --processes fresh processes allocates --buffers buffers of --mb MB of bf16 weights on huge
pages (kernels/host_memory.py, as the loader's arena holds a layer), made of [7168, 1024] matrices (an
expert's gate_up in issue 25's checkpoint), then reads each buffer whole --rounds times through
flowmoe's one-row GEMV kernel (cpu_expert.linear_rows: a decode step's expert and projection reads)
at --threads threads; a buffer's rate is its best round's (bytes / wall seconds). Prints a table of
the rates by process and buffer and writes bench/memory_placement.json, the CPU named.

    python bench/memory_placement.py [--processes 5] [--buffers 4] [--mb 220] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHAPE = (7168, 1024)  # an expert's gate_up [2I, hidden] in issue 25's checkpoint


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=5)
    parser.add_argument("--buffers", type=int, default=4)
    parser.add_argument("--mb", type=int, default=220, help="MB of bf16 weights per buffer")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=HERE / "memory_placement.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def worker(args: argparse.Namespace) -> list[float]:
    """GB/s of each of this process's buffers (the best of --rounds passes)."""
    import torch

    from flowmoe.kernels import cpu_expert
    from flowmoe.kernels.host_memory import huge_copy

    if cpu_expert.library() is None:
        raise SystemExit("memory_placement: no C compiler for flowmoe's CPU kernels here")
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    per_buffer = max(1, round(args.mb * 1e6 / (SHAPE[0] * SHAPE[1] * 2)))
    x = torch.randn(1, SHAPE[1], generator=generator).to(torch.bfloat16)  # [1, hidden]
    rates = []
    for _ in range(args.buffers):
        weights = [
            huge_copy(torch.randn(SHAPE, generator=generator).to(torch.bfloat16)) for _ in range(per_buffer)
        ]
        seconds = []
        for _ in range(args.rounds + 1):  # the first pass faults nothing in (copied), but warms the code
            start = time.perf_counter()
            for w in weights:
                cpu_expert.linear_rows(x, w)  # [1, 7168]
            seconds.append(time.perf_counter() - start)
        rates.append(sum(w.nbytes for w in weights) / min(seconds[1:]) / 1e9)
        del weights
    return rates


def main() -> None:
    args = arguments()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    from rich.console import Console
    from rich.table import Table

    from flowmoe.kernels.native import cpuinfo_field

    command = [sys.executable, __file__, "--worker", *(f"--{k}={getattr(args, k)}" for k in
               ("buffers", "mb", "threads", "rounds"))]  # fmt: skip
    runs = []
    for p in range(args.processes):
        done = subprocess.run(command, capture_output=True, text=True, cwd=HERE.parent)
        if done.returncode:
            raise SystemExit(f"memory_placement: process {p} failed: {done.stderr[-2000:]}")
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    every = [r for run in runs for r in run]
    cpu = f"{cpuinfo_field('model name')}, {len(os.sched_getaffinity(0))} cores"
    table = Table(title=f"GEMV read rate, GB/s, bf16, {args.threads} threads, {args.mb} MB buffers — {cpu}")
    table.add_column("process", justify="right")
    for b in range(args.buffers):
        table.add_column(f"buffer {b}", justify="right")
    for p, run in enumerate(runs):
        table.add_row(str(p), *(f"{r:.1f}" for r in run))
    console = Console()
    console.print(table)
    console.print(
        f"all buffers: median {statistics.median(every):.1f}, min {min(every):.1f}, "
        f"max {max(every):.1f} GB/s; max / min {max(every) / min(every):.2f}"
    )
    saved = {
        "cpu": cpu,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "settings": {k: getattr(args, k) for k in ("processes", "buffers", "mb", "threads", "rounds")},
        "gb_s": runs,
    }
    args.out.write_text(json.dumps(saved, indent=1) + "\n")


if __name__ == "__main__":
    main()
