"""Where a CPU decode step's time goes (issue 25): each node's time, the C kernels' time inside it
and the weight bytes they read (so their GB/s against the machine's read roof), the node's own
Python and torch calls, and what runs outside the nodes (the engine, the plan, the executor).

One process per dtype, the runtime `flowmoe run` builds without a GPU (the cpu scheduler, or
`--scheduler`'s; no trace); a batch of
`--batch` prompts of `--prompt` tokens, greedy. Each round: the read roof at the run's thread count
(torch.sum over `--roof-mib` MiB on huge pages, 1 GiB by default, wall clock, the best sample
kept); a plain run (no instrumentation, vs_llamacpp's clock: the median decode step, wall and
CPU); then a profiled run, every node's action and every C kernel wrapper timed (the wrappers add
a few us a call: the profiled step is printed beside the plain one). The first two steps (prefill,
first decode) are left out. A kernel's weight bytes are those its call reads once (a projection's
weight, a layer's routed experts' gate_up and down, the projection inside an attention side's one
call); the norms', rope's, router tail's and KV write's are counted as none (their weights are ~0.1%
of a step's).

Medians over rounds, per step. Prints a table per (dtype, threads) by node op and one by kernel
wrapper (with `--scheduler cpu`, the default, a layer's kernels in one LAYER node: the second table
splits it), writes bench/decode_profile.json
with the CPU named. The checkpoint is vs_llamacpp's (run that bench once, or pass --model).

    python bench/decode_profile.py [--model DIR] [--dtypes bfloat16,float32] [--threads 1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from vs_llamacpp import CACHE, Clock, machine
from vs_transformers import flowmoe_generate

from flowmoe.core.plan import TaskNode
from flowmoe.core.policy import Policy
from flowmoe.kernels import (
    cpu_attention,
    cpu_attention_ends,
    cpu_combine,
    cpu_expert,
    cpu_kv,
    cpu_norm,
    cpu_rope,
    cpu_router,
)
from flowmoe.kernels.host_memory import huge_empty
from flowmoe.model.loading import load_model
from flowmoe.runtime.actions import StepState
from flowmoe.runtime.runner import Runtime
from flowmoe.schedulers.registry import default_name

HERE = Path(__file__).resolve().parent
MODEL = CACHE / "mixtral-h1024-i3584-l8-e8-v32000"  # vs_llamacpp.py's checkpoint, issue 25's shape
OUTSIDE = "outside nodes"
SKIPPED = 2  # steps left out: the prefill and the first decode step


def _projection_bytes(args: tuple) -> int:
    return int(args[1].nbytes)  # linear_rows(x, weight, ...)


def _pre_bytes(args: tuple) -> int:
    return int(args[3].nbytes)  # pre_attention(hidden, norm, eps, weight, ...)


def _post_bytes(args: tuple) -> int:
    return int(args[1].nbytes)  # post_attention(attn, weight, ...)


def _experts_bytes(args: tuple) -> int:
    ffns = args[4]  # swiglu_routed(x, rows, scales, counts, ffns, ...)
    return sum(int(f[0].nbytes + f[1].nbytes) for f in ffns)


# (module, function, the weight bytes a call reads from its arguments, or None)
KERNELS: tuple[tuple[Any, str, Callable[[tuple], int] | None], ...] = (
    (cpu_expert, "linear_rows", _projection_bytes),
    (cpu_attention_ends, "pre_attention", _pre_bytes),  # norm, q/k/v projection and rope in one call
    (cpu_attention_ends, "post_attention", _post_bytes),  # o projection, residual add and norm
    (cpu_expert, "swiglu_routed", _experts_bytes),
    (cpu_attention, "decode", None),
    (cpu_norm, "normed", None),
    (cpu_combine, "combine", None),
    (cpu_kv, "write", None),
    (cpu_rope, "rotate_", None),
    (cpu_router, "tail", None),
)


class Profile:
    """Seconds per node op, seconds and weight bytes of the C kernels per op they ran in, while `on`."""

    def __init__(self) -> None:
        self.on = False
        self.op = OUTSIDE
        self.nodes: Counter[str] = Counter()
        self.kernels: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        # the same by kernel wrapper ("cpu_expert.swiglu_routed", ...): seconds, weight bytes, calls
        self.by_kernel: Counter[str] = Counter()
        self.kernel_bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._undo: list[Callable[[], None]] = []

    def install(self) -> None:
        for module, name, weight_bytes in KERNELS:
            self._wrap_kernel(module, name, weight_bytes)
        bind = StepState.action

        def action(state: StepState, node: TaskNode) -> Any:
            run = bind(state, node)
            op = node.op.name

            def timed() -> None:
                self.op, started = op, time.perf_counter()
                try:
                    run()
                finally:
                    if self.on:
                        self.nodes[op] += time.perf_counter() - started
                    self.op = OUTSIDE

            return timed

        StepState.action = action  # type: ignore[method-assign]
        self._undo.append(lambda: setattr(StepState, "action", bind))

    def _wrap_kernel(self, module: Any, name: str, weight_bytes: Callable[[tuple], int] | None) -> None:
        kernel = getattr(module, name)
        label = f"{module.__name__.rsplit('.', 1)[-1]}.{name}"

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            out = kernel(*args, **kwargs)
            if self.on:
                seconds = time.perf_counter() - started
                self.kernels[self.op] += seconds
                self.by_kernel[label] += seconds
                self.calls[label] += 1
                if weight_bytes is not None and out is not None:  # None: the call's chain not taken
                    read = weight_bytes(args)
                    self.bytes[self.op] += read
                    self.kernel_bytes[label] += read
            return out

        setattr(module, name, timed)
        self._undo.append(lambda: setattr(module, name, kernel))

    def uninstall(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


class ProfiledClock(Clock):
    """Turns the profile on at the step after the SKIPPED ones."""

    def __init__(self, profile: Profile) -> None:
        super().__init__()
        self.profile = profile

    def tick(self) -> None:
        super().tick()
        if len(self.marks) == SKIPPED + 2:  # construction, then one tick per step
            self.profile.on = True


def read_roof(buffer: torch.Tensor) -> float:
    """GB/s of one torch.sum over `buffer` at the current intra-op thread count (wall clock)."""
    started = time.perf_counter()
    buffer.sum()
    return buffer.nbytes / (time.perf_counter() - started) / 1e9


def profile_cell(
    model: Any,
    threads: int,
    prompts: list[list[int]],
    steps: int,
    rounds: int,
    roof_bytes: int,
    scheduler: str,
) -> dict:
    runtime = Runtime.create(model, scheduler, Policy(cpu_threads=threads), "cpu", record=False)
    buffer = huge_empty(roof_bytes).view(torch.float32).fill_(1.0)
    torch.set_num_threads(threads)  # the roof's (the runtime sets its own thread's team)
    flowmoe_generate(model, runtime, prompts, 4)
    roof, plain, profiled, cpu = [], [], [], []
    shares: dict[str, list[tuple[float, float, float]]] = {}
    by_kernel: dict[str, list[tuple[float, float, float]]] = {}  # wrapper -> (s, bytes, calls) per step
    try:
        for _ in range(rounds):
            roof.append(max(read_roof(buffer) for _ in range(3)))
            clock = Clock()
            flowmoe_generate(model, runtime, prompts, steps + SKIPPED, clock)
            kept = clock.steps()[SKIPPED:]
            plain.append(statistics.median(w for w, _ in kept))
            cpu.append(statistics.median(c for _, c in kept))
            profile = Profile()
            profile.install()
            try:
                profiled_clock = ProfiledClock(profile)
                flowmoe_generate(model, runtime, prompts, steps + SKIPPED, profiled_clock)
                ended = time.perf_counter()
            finally:
                profile.uninstall()
            counted = steps  # from the SKIPPED steps' end to the run's
            step = (ended - profiled_clock.marks[SKIPPED + 1][0]) / counted
            profiled.append(step)
            profile.nodes[OUTSIDE] = step * counted - sum(profile.nodes.values())
            for op, seconds in profile.nodes.items():
                shares.setdefault(op, []).append(
                    (seconds / counted, profile.kernels[op] / counted, profile.bytes[op] / counted)
                )
            for label, seconds in profile.by_kernel.items():
                by_kernel.setdefault(label, []).append(
                    (seconds / counted, profile.kernel_bytes[label] / counted, profile.calls[label] / counted)
                )
    finally:
        runtime.close()
    best_roof = max(roof)
    ops = []
    for op, samples in shares.items():
        node, kernels, weights = medians(samples)
        rate, share = read_rate(weights, kernels, best_roof)
        ops.append({
            "op": op, "ms": node * 1e3, "kernel_ms": kernels * 1e3, "python_ms": (node - kernels) * 1e3,
            "weight_mb": weights / 1e6, "kernel_gbs": rate, "roof_share": share,
        })  # fmt: skip
    kernels = []
    for label, samples in by_kernel.items():
        seconds, weights, calls = medians(samples)
        rate, share = read_rate(weights, seconds, best_roof)
        kernels.append({
            "kernel": label, "calls": calls, "ms": seconds * 1e3, "us_per_call": seconds * 1e6 / calls,
            "weight_mb": weights / 1e6, "gbs": rate, "roof_share": share,
        })  # fmt: skip
    kernel_ms = sum(o["kernel_ms"] for o in ops)
    weight_mb = sum(o["weight_mb"] for o in ops)
    return {
        "threads": threads, "roof_gbs": best_roof, "roof_samples": roof,
        "step_ms": statistics.median(plain) * 1e3, "step_cpu_ms": statistics.median(cpu) * 1e3,
        "profiled_step_ms": statistics.median(profiled) * 1e3, "kernel_ms": kernel_ms, "weight_mb": weight_mb,
        "at_roof_ms": weight_mb / best_roof, "host_ms": statistics.median(plain) * 1e3 - kernel_ms,
        "ops": ops, "kernels": kernels,
    }  # fmt: skip


def medians(samples: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """Each field's median over the rounds' samples."""
    first, second, third = (statistics.median(s[i] for s in samples) for i in range(3))
    return first, second, third


def read_rate(weights: float, seconds: float, roof: float) -> tuple[float | None, float | None]:
    """(GB/s, share of the read roof) of `weights` bytes read in `seconds`; None where it read none."""
    rate = weights / seconds / 1e9 if seconds > 0 and weights > 0 else None
    return rate, rate / roof if rate else None


def ranked(title: str, columns: tuple[str, ...], rows: list[tuple[float, list[str]]]) -> Table:
    """A table of `columns` (the first the rows' name, left) with its (sort key, cells) rows, largest
    key first."""
    table = Table(title=title)
    table.add_column(columns[0], overflow="fold")  # a long name folds onto more lines, the figures stay whole
    for column in columns[1:]:
        table.add_column(column, justify="right")
    for _, cells in sorted(rows, key=lambda row: -row[0]):
        table.add_row(*cells)
    return table


def rate_cells(rate: float | None, share: float | None) -> list[str]:
    """A GB/s and a % of the roof, each blank where the kernel read no weights."""
    return [f"{rate:.1f}" if rate else "", f"{100 * share:.0f}" if share else ""]


def show(console: Console, dtype: str, cell: dict) -> None:
    title = (
        f"{dtype}, {cell['threads']} thread(s): step {cell['step_ms']:.2f} ms plain "
        f"({cell['profiled_step_ms']:.2f} profiled); kernels {cell['kernel_ms']:.2f} ms for "
        f"{cell['weight_mb']:.0f} MB ({cell['at_roof_ms']:.2f} ms at the {cell['roof_gbs']:.1f} GB/s roof); "
        f"the rest {cell['host_ms']:.2f} ms"
    )
    ops = [(o["ms"], [o["op"], f"{o['ms']:.3f}", f"{o['kernel_ms']:.3f}", f"{o['python_ms']:.3f}",
                      f"{o['weight_mb']:.1f}", *rate_cells(o["kernel_gbs"], o["roof_share"])])
           for o in cell["ops"]]  # fmt: skip
    columns = ("op", "ms/step", "C kernels ms", "Python ms", "weights MB", "kernels GB/s", "% roof")
    console.print(ranked(title, columns, ops))
    kernels = [(k["ms"], [k["kernel"], f"{k['calls']:.0f}", f"{k['ms']:.3f}", f"{k['us_per_call']:.1f}",
                          f"{k['weight_mb']:.1f}", *rate_cells(k["gbs"], k["roof_share"])])
               for k in cell["kernels"]]  # fmt: skip
    columns = ("kernel", "calls/step", "ms/step", "us/call", "weights MB", "GB/s", "% roof")
    by_wrapper = "the same step by kernel wrapper (its checks, ctypes call and kernel)"
    console.print(ranked(by_wrapper, columns, kernels))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    parser.add_argument("--steps", type=int, default=40, help="decode steps measured per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--roof-mib", type=int, default=1024, help="MiB summed for the read roof")
    parser.add_argument(
        "--scheduler", default=default_name(cuda=False),
        help="what runs the step (default: `flowmoe run`'s on a CPU, a node per layer; eager: a node per op, "
        "so the table splits the layer by op)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=HERE / "decode_profile.json")
    args = parser.parse_args()
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"{args.model}: no checkpoint (run bench/vs_llamacpp.py once, or pass --model)")
    if args.steps < 2:
        raise SystemExit("--steps: at least 2")
    console, cells = Console(), []
    load = [os.getloadavg()[0]]
    for dtype in args.dtypes.split(","):
        model = load_model(args.model, dtype)
        rng = random.Random(1)
        vocab = model.spec.vocab
        prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt)] for _ in range(args.batch)]
        for threads in (int(t) for t in args.threads.split(",")):
            steps, roof_bytes = args.steps, args.roof_mib << 20
            measured = profile_cell(model, threads, prompts, steps, args.rounds, roof_bytes, args.scheduler)
            cell = {"dtype": dtype, "batch": args.batch, **measured}
            load.append(os.getloadavg()[0])
            show(console, dtype, cell)
            cells.append(cell)
        del model
    meta = {**machine(), "model": str(args.model), "steps": args.steps, "rounds": args.rounds,
            "prompt": args.prompt, "load": [min(load), max(load)], "torch": torch.__version__,
            "scheduler": args.scheduler}  # fmt: skip
    args.out.write_text(json.dumps({"meta": meta, "cells": cells}, indent=1) + "\n")
    where = f"{meta['cpu']} ({', '.join(meta['simd'])}), load {min(load):.1f}-{max(load):.1f}"
    console.print(f"{where}; wrote {args.out}")


if __name__ == "__main__":
    main()
