"""The five source papers' published numbers next to the simulator's (`flowmoe reproduce all`).

Runs every setting of `flowmoe.study.reproduce` (the numbers and their citations are in
`flowmoe/study/reproduce/paper_numbers.py`), prints the per-setting tables and the summary as
`flowmoe reproduce` does, and writes bench/paper_setups.json with the wall time and the machine.

    python bench/paper_setups.py [--paper moe-lightning|klotski|lru-cache|pre-gated|fiddler|all] [--quick]
    python bench/paper_setups.py --markdown FILE.json   # the tables for bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any

from rich.console import Console

from flowmoe.cli.reproduce import setting_table, speedup_table, summary_table
from flowmoe.study.reproduce import PAPERS, settings
from flowmoe.study.reproduce.run import run_setting, summary

console = Console()
OUT = __file__.replace(".py", ".json")


def _n(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(data: dict[str, Any]) -> str:
    """Per paper: one table of every published figure (paper, simulated, ratio, bound, ranking), one of
    the speedups; then the summary."""
    lines: list[str] = []
    for paper in PAPERS:
        chosen = [s for s in data["settings"] if s["paper"] == paper]
        if not chosen:
            continue
        header = "| setting | system (stand-in) | paper | simulated | sim/paper | bound by | ranking |"
        lines += [f"#### {paper}", "", header, "|---|---|---:|---:|---:|---|---|"]
        for s in chosen:
            holds = {True: "holds", False: "differs", None: ""}[s["ranking"]["holds"]]
            for r in s["rows"]:
                sim = _n(r["simulated"], 3) if r["error"] is None else "cannot run"
                system = f"{r['system']} ({r['scheduler']})"
                lines.append(f"| {s['setting']} | {system} | {_n(r['published'], 3)} | {sim} | "
                             f"{_n(r['ratio'])} | {r['bound']} | {holds} |")  # fmt: skip
        speedups = [(s["setting"], x) for s in chosen for x in s["speedups"]]
        if speedups:
            lines += ["", "| setting | speedup | paper | simulated | sim/paper |", "|---|---|---:|---:|---:|"]
            for setting, x in speedups:
                lines.append(f"| {setting} | {x['faster']} / {x['slower']} | {_n(x['published'])} | "
                             f"{_n(x['simulated'])} | {_n(x['ratio'])} |")  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--paper", default="all", choices=(*PAPERS, "all"))
    parser.add_argument("--quick", action="store_true", help="one small setting per paper")
    parser.add_argument(
        "--markdown", help="print the tables of a JSON this script (or reproduce --json) wrote"
    )
    args = parser.parse_args()
    if args.markdown:
        with open(args.markdown) as handle:
            print(markdown(json.load(handle)))
        return
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
