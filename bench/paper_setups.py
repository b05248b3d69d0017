"""The five source papers' published numbers next to the simulator's (`flowmoe reproduce all`).

Runs every setting of `flowmoe.study.reproduce` (the numbers and their citations are in
`flowmoe/study/paper_numbers.py`), prints the per-setting tables and the summary as
`flowmoe reproduce` does, and writes bench/paper_setups.json with the wall time and the machine.

    python bench/paper_setups.py [--paper moe-lightning|klotski|lru-cache|pre-gated|fiddler|all] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

from rich.console import Console

from flowmoe.cli.reproduce import setting_table, speedup_table, summary_table
from flowmoe.study.reproduce import PAPERS, run_setting, settings, summary

console = Console()
OUT = __file__.replace(".py", ".json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--paper", default="all", choices=(*PAPERS, "all"))
    parser.add_argument("--quick", action="store_true", help="one small setting per paper")
    args = parser.parse_args()
    started, results = time.time(), []
    for setting in settings(args.paper, args.quick):
        with console.status(f"{setting.paper}: {setting.name}"):
            results.append(run_setting(setting))
        console.print(setting_table(results[-1]))
        if results[-1]["speedups"]:
            console.print(speedup_table(results[-1]))
    machine = f"{platform.node()} ({os.cpu_count()} CPUs)"
    data = {"paper": args.paper, "quick": args.quick, "settings": results, "summary": summary(results),
            "machine": machine, "wall_seconds": time.time() - started}  # fmt: skip
    console.print(summary_table(data["summary"]))
    tmp = f"{OUT}.tmp"
    with open(tmp, "w") as handle:
        json.dump(data, handle, indent=1)
    os.replace(tmp, OUT)
    console.print(f"wrote {OUT} in {data['wall_seconds']:.0f} s")


if __name__ == "__main__":
    main()
