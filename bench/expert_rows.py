"""The bf16 / fp32 expert FFN kernel (kernels/cpu_expert.c, cpu_rows_avx2.c) at a decode step's few
rows, from DRAM and warm, against the same kernels at a git revision (`--baseline`), alternated in
one process (bench/packed_rows.py's method, for the unquantized weights).

One expert FFN of issue 25's checkpoint (hidden 1024, intermediate 3584: gate_up [7168, 1024], down
[1024, 3584]) per `flowmoe_ffn_group` call, 1-8 rows of x in the weights' dtype, 1 thread, the block
this CPU runs (cpu_expert.isa()). "dram": 16 distinct experts' weights on huge pages
(kernels/host_memory.py), each called once per pass in turn (fp32: 705 MB, bf16: 352 MB, beyond the
LLC); "warm": one expert called 16 times (its weights in the LLC, where they fit). Each round times
one pass per library, the order flipped every round; the clock is the thread's CPU time (a shared
machine's preemption excluded). The read roof: torch.sum over 1 GiB on huge pages (1 thread),
sampled each round, the best kept. Every call's output of the two libraries is compared bit for bit
(the change must keep the bits). Prints a table, writes bench/expert_rows.json.

    python bench/expert_rows.py [--baseline REV] [--rounds N] [--rows 1,2,8] [--dtypes fp32,bf16]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from flowmoe.kernels import cpu_expert, native
from flowmoe.kernels.host_memory import huge_copy, huge_empty

ROOT = Path(__file__).resolve().parent.parent
HIDDEN, INTER, EXPERTS, VOCAB, LM_HEADS = 1024, 3584, 16, 32000, 2
FILES = ("cpu_expert.c", "cpu_rows_avx2.c", "bf16.h", "swiglu.h")  # what the expert kernel compiles from
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ROOF_BYTES = 1 << 30


def expert_library(rev: str | None, folder: Path) -> ctypes.CDLL:
    """The expert kernels at git revision `rev` (None: the working tree's), compiled alone as native.py
    compiles them (both libraries alike: no other kernel moves their code)."""
    folder.mkdir()
    for name in FILES:
        if rev is None:
            (folder / name).write_bytes((ROOT / "kernels" / name).read_bytes())
        else:
            shown = subprocess.run(
                ["git", "show", f"{rev}:kernels/{name}"], cwd=ROOT, capture_output=True, check=True
            )
            (folder / name).write_bytes(shown.stdout)
    out = folder / "expert.so"
    sources = [str(folder / n) for n in FILES if n.endswith(".c")]
    subprocess.run(["cc", *native.FLAGS, *sources, "-o", str(out), "-lm"], check=True)
    return ctypes.CDLL(str(out))


def kernel(lib: ctypes.CDLL, name: str) -> Any:
    """`lib`'s function `name`, declared as cpu_expert declares the library's own."""
    declared = cpu_expert.library()
    assert declared is not None, "no C compiler for the CPU kernels here"
    fn, own = getattr(lib, name), getattr(declared, name)
    fn.argtypes, fn.restype = own.argtypes, own.restype
    return fn


def experts(dtype: torch.dtype, count: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
    """`count` experts' (gate_up [2 INTER, HIDDEN], down [HIDDEN, INTER]) on huge pages, and one's bytes."""
    generator = torch.Generator().manual_seed(0)
    made = [
        (
            huge_copy((torch.randn(2 * INTER, HIDDEN, generator=generator) * 0.03).to(dtype)),
            huge_copy((torch.randn(HIDDEN, INTER, generator=generator) * 0.03).to(dtype)),
        )
        for _ in range(count)
    ]
    return made, sum(t.numel() * t.itemsize for t in made[0])


class Calls:
    """One library's calls over the experts: x [rows, HIDDEN] -> out [rows, HIDDEN] per expert."""

    def __init__(self, fn: Any, weights: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor) -> None:
        self.fn, self.x, self.bf16 = fn, x, int(x.dtype == torch.bfloat16)
        self.gate_ups = [native.pointers([gu.data_ptr()]) for gu, _ in weights]
        self.downs = [native.pointers([d.data_ptr()]) for _, d in weights]
        self.outs = [torch.empty_like(x) for _ in weights]
        self.block = cpu_expert.ISAS[cpu_expert.isa()]

    def run(self, e: int, into: int) -> None:
        none = native.pointers([None])
        rows = (ctypes.c_int * 1)(self.x.shape[0])
        x, out = native.pointers([self.x.data_ptr()]), self.outs[into].data_ptr()
        # one expert, no biases, plain SwiGLU, this CPU's block, 1 thread
        status = self.fn(
            1,
            x,
            rows,
            HIDDEN,
            INTER,
            self.gate_ups[e],
            self.downs[e],
            self.bf16,
            none,
            none,
            0,
            0.0,
            0.0,
            out,
            self.block,
            1,
        )
        assert status == 0

    def dram(self) -> None:
        for e in range(len(self.gate_ups)):
            self.run(e, e)

    def warm(self) -> None:
        for e in range(len(self.gate_ups)):
            self.run(0, e)


class LinearCalls(Calls):
    """One library's `flowmoe_linear` calls: x [rows, HIDDEN] @ an LM head's weight [VOCAB, HIDDEN]^T
    (each of LM_HEADS distinct copies on huge pages, beyond the LLC) -> out [rows, VOCAB]."""

    def __init__(self, fn: Any, weights: list[torch.Tensor], x: torch.Tensor) -> None:
        self.fn, self.x, self.bf16 = fn, x, int(x.dtype == torch.bfloat16)
        self.weights = weights
        self.gate_ups = [native.pointers([w.data_ptr()]) for w in weights]  # dram / warm count these
        self.outs = [torch.empty(x.shape[0], VOCAB, dtype=x.dtype) for _ in weights]
        self.block = cpu_expert.ISAS[cpu_expert.isa()]

    def run(self, e: int, into: int) -> None:
        x, w, out = self.x, self.weights[e], self.outs[into]
        # no bias, this CPU's block, 1 thread
        status = self.fn(
            x.data_ptr(),
            HIDDEN,
            x.shape[0],
            HIDDEN,
            w.data_ptr(),
            self.bf16,
            VOCAB,
            None,
            out.data_ptr(),
            VOCAB,
            self.block,
            1,
        )
        assert status == 0


def clocked(fn: Callable[[], object]) -> float:
    started = time.thread_time()
    fn()
    return time.thread_time() - started


def compared(
    calls: dict[str, Calls], rounds: int, roof_read: Callable[[], object]
) -> tuple[dict[str, tuple[list[float], list[float]]], float]:
    """Per mode: the old and the new library's ms a call over `rounds` alternated rounds (the outputs
    compared bit for bit each round); and the best read roof (GB/s) of roof_read sampled each round."""
    count, roof = len(calls["old"].gate_ups), 0.0
    times: dict[tuple[str, str], list[float]] = {(n, m): [] for n in calls for m in ("dram", "warm")}
    for r in range(rounds):
        roof = max(roof, ROOF_BYTES / clocked(roof_read) / 1e9)
        for mode in ("dram", "warm"):
            for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
                c = calls[name]
                if mode == "warm":
                    c.run(0, 0)
                times[name, mode].append(clocked(getattr(c, mode)) / count * 1e3)
        for e in range(count):
            assert torch.equal(calls["old"].outs[e], calls["new"].outs[e]), "the bits moved"
    return {m: (times["old", m], times["new", m]) for m in ("dram", "warm")}, roof


def summary(
    kind: str, dtype: str, rows: int, mode: str, old: list[float], new: list[float], nbytes: int
) -> dict[str, Any]:
    """A table row: medians of the ms, of the per-round speedups (with min and max), and GB/s."""
    speedups = sorted(a / b for a, b in zip(old, new, strict=True))
    old_ms, new_ms = statistics.median(old), statistics.median(new)
    return {
        "kernel": kind,
        "dtype": dtype,
        "rows": rows,
        "mode": mode,
        "old_ms": old_ms,
        "new_ms": new_ms,
        "speedup": statistics.median(speedups),
        "speedup_min": speedups[0],
        "speedup_max": speedups[-1],
        "bytes": nbytes,
        "old_gbs": nbytes / old_ms / 1e6,
        "new_gbs": nbytes / new_ms / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", default="HEAD", help="git revision of the kernels to compare against")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--rows", default="1,2,8")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--kernels", default="ffn,lm_head")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "expert_rows.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = [os.getloadavg()[0]]
    roof_buf = huge_empty(ROOF_BYTES).view(torch.float32).fill_(1.0)
    roof, results = 0.0, []
    with tempfile.TemporaryDirectory() as tmp:
        libs = {
            name: expert_library(rev, Path(tmp) / name)
            for name, rev in (("old", args.baseline), ("new", None))
        }
        for kind in args.kernels.split(","):
            for dtype_name in args.dtypes.split(","):
                dtype = DTYPES[dtype_name]
                if kind == "ffn":
                    weights, nbytes = experts(dtype, EXPERTS)
                    fns = {name: kernel(lib, "flowmoe_ffn_group") for name, lib in libs.items()}
                else:
                    generator = torch.Generator().manual_seed(0)
                    heads = [
                        huge_copy(torch.randn(VOCAB, HIDDEN, generator=generator).to(dtype))
                        for _ in range(LM_HEADS)
                    ]
                    nbytes = heads[0].numel() * heads[0].itemsize
                    fns = {name: kernel(lib, "flowmoe_linear") for name, lib in libs.items()}
                for rows in (int(r) for r in args.rows.split(",")):
                    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows)).to(dtype)
                    calls = {
                        name: Calls(fn, weights, x) if kind == "ffn" else LinearCalls(fn, heads, x)
                        for name, fn in fns.items()
                    }
                    times, best = compared(calls, args.rounds, roof_buf.sum)
                    roof = max(roof, best)
                    results += [summary(kind, dtype_name, rows, m, *times[m], nbytes) for m in times]
                    load.append(os.getloadavg()[0])
    table = Table(title=f"{args.baseline} (old) vs working tree (new), 1 thread, {args.rounds} rounds")
    columns = (
        "kernel",
        "dtype",
        "rows",
        "mode",
        "old ms",
        "new ms",
        "old GB/s",
        "new GB/s",
        "new % roof",
        "speedup",
    )
    for column in columns:
        table.add_column(column)
    for res in results:
        speedup = f"{res['speedup']:.2f}x [{res['speedup_min']:.2f}, {res['speedup_max']:.2f}]"
        old_gbs, new_gbs = f"{res['old_gbs']:.1f}", f"{res['new_gbs']:.1f}"
        share = f"{100 * res['new_gbs'] / roof:.0f}"
        cells = (
            res["kernel"],
            res["dtype"],
            str(res["rows"]),
            res["mode"],
            f"{res['old_ms']:.3f}",
            f"{res['new_ms']:.3f}",
        )
        table.add_row(*cells, old_gbs, new_gbs, share, speedup)
    Console(width=160).print(table)
    print(f"read roof {roof:.1f} GB/s (1 thread); load average {min(load):.2f}-{max(load):.2f}")
    record = {
        "baseline": args.baseline,
        "rounds": args.rounds,
        "cpu": native.cpuinfo_field("model name"),
        "block": cpu_expert.isa(),
        "read_roof_gbs": roof,
        "load": [min(load), max(load)],
        "rows": results,
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
