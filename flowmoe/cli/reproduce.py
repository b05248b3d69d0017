"""`flowmoe reproduce`: the five source papers' published numbers next to the simulator's.

One table per setting (paper vs simulated per system, their ratio, the lane that bounds the run,
the policy run), the speedups between systems, whether the ranking holds, and a summary against
the targets (ranking equal in every setting; speedups within ±25% median and 2x worst; absolute
tokens/s within ±35% median). `--json` prints it all as one object, `--plot` draws each figure's
ratio simulated / paper, paper by paper, against the targets.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.table import Table

from flowmoe.cli.ui import out, steps, table
from flowmoe.cli.writes import add_force_flag, write_guard
from flowmoe.core.figure import PLOT, check_suffix
from flowmoe.study.reproduce import PAPERS, settings
from flowmoe.study.reproduce.run import MISSES_EXPLAINED, run_setting, summary


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("reproduce", help="the source papers' published numbers, simulated side by side")
    parser.add_argument(
        "paper", nargs="?", default="all", choices=(*PAPERS, "all"), metavar="PAPER",
        help=f"the paper whose settings are simulated: {', '.join(PAPERS)}, or all (default)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="one small setting per paper")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    parser.add_argument(
        "--plot",
        type=Path,
        help="a dot plot of each figure's ratio simulated / paper, per paper (.png, .svg or .pdf)",
    )
    add_force_flag(parser)
    parser.set_defaults(handler=_reproduce)


def _reproduce(args: argparse.Namespace) -> int:
    guard = write_guard(args, [("--plot", args.plot, PLOT)])
    if args.plot is not None:
        check_suffix(args.plot, "--plot")
    chosen = settings(args.paper, args.quick)
    results = []
    with steps("reproducing", len(chosen)) as done:
        for setting in chosen:
            results.append(run_setting(setting))
            done(f"{setting.paper}: {setting.name}")
    data = {"paper": args.paper, "quick": args.quick, "settings": results, "summary": summary(results)}
    if args.plot is not None:
        from flowmoe.study.reproduce.plot import plot_reproduction

        plot_reproduction(results, args.plot, guard)
    if args.json:
        print(json.dumps(data))
        return 0
    for result in results:
        out.print(setting_table(result))
        if result["speedups"]:
            out.print(speedup_table(result))
        out.print(f"[dim]{result['note']}[/]", soft_wrap=True)
    out.print(summary_table(data["summary"]))
    if data["summary"]["targets"]:
        out.print(targets_table(data["summary"]))
    if any(not t["met"] for t in data["summary"]["targets"]):
        out.print(misses_pointer(args.paper), soft_wrap=True, highlight=False)
    if args.plot is not None:
        out.print(f"plot: {args.plot}")
    return 0


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def setting_table(result: dict[str, Any]) -> Table:
    """A setting's systems, paper vs simulated (each one's policy: --json)."""
    ranking = result["ranking"]
    holds = {True: "[green]ranking holds[/]", False: "[red]ranking differs[/]", None: ""}[ranking["holds"]]
    metric = result["rows"][0]["metric"] if result["rows"] else ""
    columns = ("system", "stand-in", f"paper\n{metric}", "simulated", "sim /\npaper", "bound by")
    shown = table(f"{result['setting']} — {result['where']} {holds}", columns, "right", prose=("system",))
    errors = []
    for r in result["rows"]:
        simulated = _num(r["simulated"], 3) if r["error"] is None else "[yellow]cannot run[/]"
        if r["error"] is not None:
            errors.append(f"{r['system']} ({r['scheduler']}) cannot run: {r['error']}")
        implied = r.get("implied")
        paper = f"({implied:.3f})" if r["published"] is None and implied else _num(r["published"], 3)
        shown.add_row(r["system"], r["scheduler"], paper, simulated, _num(r["ratio"]), r["bound"])
    shown.caption = "(paper): implied by a ratio the paper gives; ranked, not counted as a figure"
    if ranking["holds"] is False:
        shown.caption = (
            f"paper: {' > '.join(ranking['paper'])}; simulated: {' > '.join(ranking['simulated'])}"
        )
    shown.caption = "\n".join([shown.caption, *errors])
    return shown


def speedup_table(result: dict[str, Any]) -> Table:
    columns = ("faster / slower", "paper", "simulated", "sim / paper")
    shown = table(f"{result['setting']}: speedups", columns, "right", prose=("faster / slower",))
    for s in result["speedups"]:
        paper = _num(s["published"]) + (f" ({s['low']}-{s['high']})" if s["low"] is not None else "")
        shown.add_row(f"{s['faster']} / {s['slower']}", paper, _num(s["simulated"]), _num(s["ratio"]))
    return shown


def summary_table(data: dict[str, Any]) -> Table:
    columns = ("figures", "count", "median\nratio", "median\noff", "worst\noff", "≤1.25x", "≤1.35x", "≤2x")
    shown = table("reproduction summary (ratios simulated / paper; 'off' = max(r, 1/r))", columns, "right")
    for label, key in (("absolute tok/s", "absolute"), ("speedups", "speedups"), ("hit rates", "hit_rates")):
        s = data[key]
        if not s["count"]:
            continue
        shown.add_row(label, str(s["count"]), _num(s["median"]), _num(s["median_off"]), _num(s["worst_off"]),
                      str(s["within_25"]), str(s["within_35"]), str(s["within_2x"]))  # fmt: skip
    shown.caption = (
        f"rankings equal to the paper's: {data['rankings_held']} of {data['rankings']} settings; "
        f"published figures not run (the stand-in could not run): {data['not_run']}. Targets: every "
        "ranking; speedups median off ≤ 1.25, worst ≤ 2; absolute median off ≤ 1.35"
    )
    return shown


def targets_table(data: dict[str, Any]) -> Table:
    """Each target, met or missed."""
    shown = table("targets", ("target", "goal", "got", "verdict"))
    for t in data["targets"]:
        verdict = "[green]met[/]" if t["met"] else "[red]missed[/]"
        shown.add_row(t["target"], t["goal"], t["got"], verdict)
    return shown


def misses_pointer(paper: str) -> str:
    """Where bench/RESULTS.md accounts for the targets missed (and the paper's own section)."""
    line = f'why each target is missed: bench/RESULTS.md, section "{MISSES_EXPLAINED.lstrip("# ")}"'
    if paper != "all":
        line += f', and the paper\'s section "#### {paper}"'
    return f"{line}\n  grep -n -A40 'Targets missed' bench/RESULTS.md"
