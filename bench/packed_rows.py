"""The packed expert kernels (kernels/cpu_packed*.c) at a decode step's few rows, from DRAM and warm,
against the same kernels at a git revision (`--baseline`), alternated in one process.

One expert FFN of issue 25's checkpoint (hidden 1024, intermediate 3584: gate, up, down; int4 at
group 128, as flowmoe's quantizer packs it) per `flowmoe_packed_ffn_group` call, 1-8 rows of fp32 x,
1 thread, the block this CPU runs (cpu_packed.isa()), or each build its own (`--blocks OLD,NEW`:
two blocks of one build, with `--baseline HEAD` and no change). "dram": 16 distinct experts' weights on huge
pages (kernels/host_memory.py), each called once per pass in turn (int8: 176 MB, int4: 93 MB, beyond
the LLC); "warm": one expert called 16 times (its weights in the LLC). Each round times one pass per
library, the order flipped every round; the clock is the thread's CPU time (a shared machine's
preemption excluded). Packed bytes: q, scales and zeros. The read roof: torch.sum over 1 GiB on huge
pages (1 thread), sampled each round, the best kept. Every call's output of the two libraries is
compared bit for bit (the change must keep the bits). Prints a table, writes bench/packed_rows.json.

    python bench/packed_rows.py [--baseline REV] [--rounds N] [--rows 1,2,8] [--formats int8,int4]
                                [--blocks avx2,avx512]
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import torch
from kernel_revisions import Roof, builds, compared, parser, report, summary

from flowmoe.kernels import cpu_packed, native
from flowmoe.kernels.host_memory import huge_copy

HIDDEN, INTER, GROUP, EXPERTS = 1024, 3584, 128, 16
SOURCES = ("cpu_packed.c", "cpu_packed_avx2.c", "cpu_packed_avx512.c")  # and the headers they include


def kernel(lib: ctypes.CDLL) -> Any:
    """`lib`'s flowmoe_packed_ffn_group, declared as cpu_packed declares the library's own."""
    declared = cpu_packed.kernel()
    assert declared is not None, "no C compiler for the CPU kernels here"
    fn = lib.flowmoe_packed_ffn_group
    fn.argtypes, fn.restype = declared.argtypes, declared.restype  # type: ignore[attr-defined]
    return fn


def projection(fmt: str, rows: int, cols: int, generator: torch.Generator) -> list[torch.Tensor]:
    """(q, scale[, zero]) of a [rows, cols] weight in `fmt`, q on huge pages."""
    if fmt == "int8":
        q = torch.randint(-127, 128, (rows, cols), dtype=torch.int8, generator=generator)
        return [huge_copy(q), torch.rand(rows, generator=generator) * 0.01]
    groups = cols // GROUP
    q = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=generator)
    scale = (torch.rand(rows, groups, generator=generator) * 0.01).half()
    zero = torch.randint(0, 16, (rows, groups), generator=generator).half()
    return [huge_copy(q), scale, zero]


def experts(fmt: str, count: int) -> tuple[list[list[torch.Tensor | None]], int]:
    """`count` experts' tensors (gate, up, down: 3 x (q, scale[, zero])) and one expert's packed bytes."""
    generator = torch.Generator().manual_seed(0)
    made: list[list[torch.Tensor | None]] = []
    for _ in range(count):
        tensors: list[torch.Tensor | None] = []
        for rows, cols in ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)):
            tensors += projection(fmt, rows, cols, generator) + ([] if fmt == "int4" else [None])
        made.append(tensors)
    return made, sum(t.numel() * t.itemsize for t in made[0] if t is not None)


class Calls:
    """One library's calls over the experts: x [rows, HIDDEN] fp32 -> out [rows, HIDDEN] per expert."""

    def __init__(
        self, fn: Any, fmt: str, weights: list[list[torch.Tensor | None]], x: torch.Tensor, block: str
    ) -> None:
        self.fn, self.fmt, self.x = fn, cpu_packed.FORMATS[fmt], x
        self.pointers = [native.pointers([None if t is None else t.data_ptr() for t in w]) for w in weights]
        self.outs = [torch.empty_like(x) for _ in weights]
        self.block = cpu_packed.BLOCKS[block]

    def run(self, e: int, into: int) -> None:
        none = native.pointers([None])
        rows = (ctypes.c_int * 1)(self.x.shape[0])
        x, out = native.pointers([self.x.data_ptr()]), self.outs[into].data_ptr()
        # one expert, no biases, plain SwiGLU, fp32 rows, this CPU's block, 1 thread
        status = self.fn(
            1,
            x,
            rows,
            HIDDEN,
            INTER,
            self.fmt,
            GROUP,
            self.pointers[e],
            none,
            none,
            0,
            0.0,
            0.0,
            0,
            out,
            self.block,
            1,
        )
        assert status == 0


def main() -> None:
    flags = parser(__doc__, "packed_rows.json")
    flags.add_argument("--formats", default="int8,int4")
    flags.add_argument("--blocks", default=None, help="the old and the new build's blocks (default isa())")
    args = flags.parse_args()
    blocks = dict(
        zip(("old", "new"), (args.blocks or f"{cpu_packed.isa()},{cpu_packed.isa()}").split(","), strict=True)
    )
    load, roof, results = [os.getloadavg()[0]], Roof(), []
    with builds(args.baseline, SOURCES) as built:
        libs = {name: kernel(lib) for name, lib in built.items()}
        for fmt in args.formats.split(","):
            weights, nbytes = experts(fmt, EXPERTS)
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows))
                calls: dict[str, Any] = {
                    name: Calls(fn, fmt, weights, x, blocks[name]) for name, fn in libs.items()
                }
                times, moved = compared(calls, EXPERTS, args.rounds, roof, args.moved_bits)
                keys = {"format": fmt, "rows": rows}
                results += [summary(keys | {"mode": m}, *times[m], nbytes, moved) for m in times]
                load.append(os.getloadavg()[0])
    title = f"packed experts: {args.baseline} (old) vs working tree (new), 1 thread, {args.rounds} rounds"
    record = {"baseline": args.baseline, "rounds": args.rounds, "blocks": blocks}
    report(title, ("format", "rows", "mode"), results, roof.best, load, record, args.out)


if __name__ == "__main__":
    main()
