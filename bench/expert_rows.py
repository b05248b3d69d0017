"""The bf16 / fp32 expert FFN kernel (kernels/cpu_expert.c, cpu_rows_avx2.c, cpu_rows_avx512.c) at a
decode step's few rows, from DRAM and warm, against the same kernels at a git revision
(`--baseline`), alternated in one process (bench/packed_rows.py's method, for the unquantized
weights).

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

import ctypes
import os
from typing import Any

import torch
from kernel_revisions import Roof, builds, compared, parser, report, summary

from flowmoe.kernels import cpu_expert, native
from flowmoe.kernels.host_memory import huge_copy

HIDDEN, INTER, EXPERTS, VOCAB, LM_HEADS = 1024, 3584, 16, 32000, 2
# what the expert kernel compiles from (cpu_rows_avx512.c: baselines from 759e9e1 on)
SOURCES = ("cpu_expert.c", "cpu_rows_avx2.c", "cpu_rows_avx512.c")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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


class LinearCalls:
    """One library's `flowmoe_linear` calls: x [rows, HIDDEN] @ an LM head's weight [VOCAB, HIDDEN]^T
    (each of LM_HEADS distinct copies on huge pages, beyond the LLC) -> out [rows, VOCAB]."""

    def __init__(self, fn: Any, weights: list[torch.Tensor], x: torch.Tensor) -> None:
        self.fn, self.x, self.bf16 = fn, x, int(x.dtype == torch.bfloat16)
        self.weights = weights
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


def main() -> None:
    flags = parser(__doc__, "expert_rows.json")
    flags.add_argument("--dtypes", default="fp32,bf16")
    flags.add_argument("--kernels", default="ffn,lm_head")
    args = flags.parse_args()
    load, roof, results = [os.getloadavg()[0]], Roof(), []
    with builds(args.baseline, SOURCES) as libs:
        for kind in args.kernels.split(","):
            for dtype_name in args.dtypes.split(","):
                dtype = DTYPES[dtype_name]
                if kind == "ffn":
                    weights, nbytes = experts(dtype, EXPERTS)
                    count = EXPERTS
                    fns = {name: kernel(lib, "flowmoe_ffn_group") for name, lib in libs.items()}
                else:
                    generator = torch.Generator().manual_seed(0)
                    heads = [
                        huge_copy(torch.randn(VOCAB, HIDDEN, generator=generator).to(dtype))
                        for _ in range(LM_HEADS)
                    ]
                    nbytes, count = heads[0].numel() * heads[0].itemsize, LM_HEADS
                    fns = {name: kernel(lib, "flowmoe_linear") for name, lib in libs.items()}
                for rows in (int(r) for r in args.rows.split(",")):
                    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows)).to(dtype)
                    calls: dict[str, Any] = {
                        name: Calls(fn, weights, x) if kind == "ffn" else LinearCalls(fn, heads, x)
                        for name, fn in fns.items()
                    }
                    times, moved = compared(calls, count, args.rounds, roof, args.moved_bits)
                    keys = {"kernel": kind, "dtype": dtype_name, "rows": rows}
                    results += [summary(keys | {"mode": m}, *times[m], nbytes, moved) for m in times]
                    load.append(os.getloadavg()[0])
    title = f"{args.baseline} (old) vs working tree (new), 1 thread, {args.rounds} rounds"
    record = {"baseline": args.baseline, "rounds": args.rounds, "block": cpu_expert.isa()}
    report(title, ("kernel", "dtype", "rows", "mode"), results, roof.best, load, record, args.out)


if __name__ == "__main__":
    main()
