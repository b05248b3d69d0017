"""What a worker that reads the next weights during the host's gaps would buy a 2-thread decode step
(issue 25): a design probe in C, before the runtime changes.

A bf16 batch-1 decode step of issue 25's checkpoint reads ~49 MB a layer (q/k/v and o, two routed
experts) and runs ~2.1-2.3 ms of Python between its kernels (bench/decode_profile.py, 2-vCPU AMD
EPYC: ~260 us a layer), while OpenMP's second thread spins and the memory bus idles. bench/
gap_prefetch.c plays such a step: per layer a gap of --gaps us on thread 0, then both threads read
the layer's --segment MiB once, each its static share in address order. In the gap thread 1 either
spins (ahead 0, today's runtime) or reads the first --aheads MiB of the layer's weights, which the
kernel then finds in the caches: what a thread pool of flowmoe's own (OpenMP's workers cannot be given
work between regions) could do with the weights it knows come next (the next layer's projections
at any time, the routed experts once the gate has run).

--pieces splits each layer into that many kernels (the layer's weights in equal parts, in order), the
gap and the read-ahead shared among them: a real layer's host time comes in ~7 gaps, one before
each of its kernels.

Each configuration runs in a fresh process (--steps steps, the first 3 left out, the median kept),
configurations alternated round by round; the paired ratio is each round's step against the same
round's ahead-0 step at the same gap and pieces (the machine's memory speed moves between minutes
on these VMs, bench/memory_placement.py). Prints a table, writes bench/gap_prefetch.json with the
CPU named.

    python bench/gap_prefetch.py [--aheads 0,2,4,6,8] [--gaps 130,260] [--pieces 1,4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from flowmoe.kernels.native import c_compiler

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
SKIPPED = 3  # first steps of a process left out (page faults, the team's start)
Config = tuple[int, int, float, str]  # gap us a layer, kernels a layer, MiB read ahead a layer, mode


def build(folder: Path) -> Path:
    """bench/gap_prefetch.c compiled for this CPU by the kernels' compiler (-O3 -march=native -fopenmp)."""
    compiler = c_compiler()  # the kernels' own choice: $CC, else cc, else gcc
    if compiler is None:
        raise SystemExit("gap_prefetch: no C compiler (cc, gcc or $CC)")
    binary = folder / "gap_prefetch"
    source = HERE / "gap_prefetch.c"
    subprocess.run([compiler, "-O3", "-march=native", "-fopenmp", str(source), "-o", str(binary)], check=True)
    return binary


def run(binary: Path, args: argparse.Namespace, config: Config, mode: int) -> float:
    """The median step (ms) of one fresh process."""
    gap, pieces, ahead_mib, _ = config
    ahead_kib = round(ahead_mib * 1024)
    numbers = (args.layers, args.segment, gap, ahead_kib, mode, args.steps + SKIPPED, args.threads, pieces)
    argv = [str(binary), *map(str, numbers)]
    spin = os.environ.get("GOMP_SPINCOUNT", "1000000")  # the idle workers spin through a gap
    env = {**os.environ, "GOMP_SPINCOUNT": spin}
    out = subprocess.run(argv, check=True, capture_output=True, text=True, env=env).stdout
    return statistics.median(json.loads(out)["step_ms"][SKIPPED:])


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--segment", type=int, default=47, help="MiB a layer's kernels read (~49 MB)")
    parser.add_argument("--gaps", default="130,260", help="us of host time a layer")
    parser.add_argument(
        "--pieces", default="1", help="kernels a layer, the gap and read-ahead split among them"
    )
    parser.add_argument("--aheads", default="0,2,4,6,8", help="MiB read ahead in each gap")
    parser.add_argument("--modes", default="load", help="load (reads) and/or prefetch (prefetcht1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=HERE / "gap_prefetch.json")
    args = parser.parse_args()
    from vs_llamacpp import machine

    gaps = [int(g) for g in args.gaps.split(",")]
    aheads = [float(a) for a in args.aheads.split(",")]
    modes = {"load": 0, "prefetch": 1}
    chosen = [m for m in args.modes.split(",") if m in modes]
    pieces = [int(p) for p in args.pieces.split(",")]
    configs: list[Config] = [
        (g, p, a, m) for g in gaps for p in pieces for a in aheads for m in (chosen if a else chosen[:1])
    ]
    steps: dict[Config, list[float]] = {c: [] for c in configs}
    paired: dict[Config, list[float]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        binary = build(Path(tmp))
        for r in range(args.rounds):
            order = configs if r % 2 == 0 else configs[::-1]
            this = {c: run(binary, args, c, modes[c[3]]) for c in order}
            for c, ms in this.items():
                steps[c].append(ms)
                paired[c].append(ms / this[(c[0], c[1], 0.0, chosen[0])])
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    rows = []
    bytes_read = args.layers * args.segment * 2**20  # a step's
    for c in configs:
        g, p, a, m = c
        step = statistics.median(steps[c])
        rows.append({
            "gap_us": g, "pieces": p, "ahead_mib": a, "mode": m, "step_ms": step, "steps_ms": steps[c],
            "paired": statistics.median(paired[c]),
            "kernel_gbs": bytes_read / ((step - args.layers * g / 1000) / 1000) / 1e9,
        })  # fmt: skip
    meta = {**machine(), "layers": args.layers, "segment_mib": args.segment, "threads": args.threads,
            "rounds": args.rounds, "steps": args.steps}  # fmt: skip
    table = Table(title=f"read ahead in the host's gaps — {meta['cpu']}, {args.threads} threads, "
                  f"{args.layers} x {args.segment} MiB a step")  # fmt: skip
    columns = (
        "gap us",
        "kernels",
        "ahead MiB",
        "mode",
        "step ms (median)",
        "÷ ahead 0, paired",
        "GB/s outside gaps",
    )
    for col in columns:
        table.add_column(col, justify="right")
    for row in rows:
        cells = (row["gap_us"], row["pieces"], f"{row['ahead_mib']:g}", row["mode"], f"{row['step_ms']:.2f}",
                 f"{row['paired']:.3f}", f"{row['kernel_gbs']:.1f}")  # fmt: skip
        table.add_row(*map(str, cells))
    Console().print(table)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
