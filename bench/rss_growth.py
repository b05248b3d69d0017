"""Resident memory over a long batch job: one process, `--prompts` prompts of random lengths in turn
(the path `flowmoe run` builds: Runtime.create with the eager scheduler, each prompt prefilled and
one token decoded), the process's RSS and peak RSS (VmHWM) every `--every` prompts. A job that keeps
something per prompt, or per shape a library meets (oneDNN makes and keeps a primitive for each
GEMM shape: kernels/linear.py), grows here where a one-prompt benchmark shows nothing (issue 25).

The checkpoint: bench/vs_llamacpp.py's (issue 25's Mixtral-architecture model, written by
transformers; run that bench once, or pass --model). Prints a table, writes bench/rss_growth.json
with the CPU named.

    python bench/rss_growth.py [--model DIR] [--dtype bfloat16] [--prompts 60] [--every 10]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table
from vs_llamacpp import CACHE, machine, peak_rss
from vs_transformers import flowmoe_generate

from flowmoe.core.policy import Policy
from flowmoe.model.loading import load_model
from flowmoe.runtime.runner import Runtime
from flowmoe.schedulers.registry import default_name

HERE = Path(__file__).resolve().parent
MODEL = CACHE / "mixtral-h1024-i3584-l8-e8-v32000"  # vs_llamacpp.py's checkpoint, issue 25's shape


def memory() -> dict[str, float]:
    """This process's resident set and its peak (vs_llamacpp's `peak_rss`), GiB."""
    with open("/proc/self/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))  # kB
    return {"rss_gib": rss / 2**20, "peak_gib": peak_rss() / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--lengths", default="40,300", help="prompt tokens, drawn uniformly from this range")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=HERE / "rss_growth.json")
    args = parser.parse_args()
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"{args.model}: no checkpoint (run bench/vs_llamacpp.py once, or pass --model)")
    shortest, longest = (int(n) for n in args.lengths.split(","))
    model = load_model(args.model, args.dtype)
    loaded = memory()
    policy = Policy(cpu_threads=args.threads)
    runtime = Runtime.create(model, default_name(cuda=False), policy, "cpu", record=False)  # as `flowmoe run`
    vocab, rng, rows, started = model.spec.vocab, random.Random(0), [], time.process_time()
    for done in range(1, args.prompts + 1):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(shortest, longest))]
        flowmoe_generate(model, runtime, [prompt], 1)
        if done % args.every == 0 or done == args.prompts:
            rows.append({"prompts": done, **memory(), "cpu_s": time.process_time() - started})
    runtime.close()
    table = Table(title=f"RSS over a batch job: {args.dtype}, {args.threads} thread(s), {args.lengths} tok")
    for column in ("prompts", "RSS GiB", "peak GiB", "CPU s"):
        table.add_column(column, justify="right")
    table.add_row("loaded", f"{loaded['rss_gib']:.3f}", f"{loaded['peak_gib']:.3f}", "")
    for row in rows:
        table.add_row(
            str(row["prompts"]), f"{row['rss_gib']:.3f}", f"{row['peak_gib']:.3f}", f"{row['cpu_s']:.1f}"
        )
    Console().print(table)
    record = {"machine": machine(), "model": str(args.model), "dtype": args.dtype, "threads": args.threads,
              "lengths": args.lengths, "loaded": loaded, "rows": rows}  # fmt: skip
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
