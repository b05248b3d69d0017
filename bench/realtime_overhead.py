"""What the host stack costs a GPU run: simulated vs real-clock makespan of decode steps at paper scale.

For cgopipe, klotski, fiddler, flexgen and lru-cache on Mixtral-8x7B (32 layers, meta weights):
- S1 and S2 of MoE-Lightning (Cao et al., ASPLOS 2025): 1 x T4 (16 GB) / 1 x L4 (24 GB) with their
  hosts (`t4`, `l4` presets), MTBench gen 32, decode;
- batch 1 on an RTX 4090 desktop (`rtx4090` preset), MTBench prompts, decode.

Policies: cgopipe runs the HRM plan (`flowmoe plan`, N capped at the ~3,100 MTBench requests the
artifact processed, as bench/paper_setups.py does); flexgen the MoE-Lightning artifact's FlexGen
policy for that machine at gen 32 (bench/paper_setups.py FLEXGEN); klotski, fiddler and lru-cache
their own best fitting policy (`flowmoe.study.best_policy`, as `flowmoe simulate` picks it). At
batch 1 every scheduler gets its best policy with N = 1.

Each row runs the same decode step twice: on the virtual clock (`makespan`) and on the real clock
(`realtime`: the real scheduler, driver, executor, lane threads and bookkeeping, each device action
replaced by waiting its modelled duration, `flowmoe simulate --realtime`). ratio = realtime /
simulated; host s/step = CPU time of the lane threads and the event loop's thread per step.

    python bench/realtime_overhead.py --label baseline [--steps 1] [--only cgopipe]

Prints a rich table; results go into bench/realtime_overhead.json under the label (other labels
are kept, so a baseline and a later run sit side by side).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from attrs import evolve
from rich.console import Console
from rich.table import Table

from flowmoe.core.hardware import hardware
from flowmoe.core.policy import Policy
from flowmoe.core.policy_search import search
from flowmoe.core.presets import preset
from flowmoe.core.synthetic_routing import RoutingModel
from flowmoe.core.workloads import workload
from flowmoe.study.best_policy import Given, best_policy
from flowmoe.study.realtime import meta_model, realtime_run
from flowmoe.study.simulate import Setup, Simulation

console = Console()
OUT = Path(__file__).with_suffix(".json")
SCHEDULERS = ("cgopipe", "klotski", "fiddler", "flexgen", "lru-cache")
MTBENCH_REQUESTS = 3072  # MoE-Lightning's artifact ran ~3,100 MTBench requests (time x tok/s / gen, its logs)
# MoE-Lightning artifact, benchmarks/flexgen/{T4,L4}/*.sh at gen 32: (gbs, num-gb, weight % on GPU).
FLEXGEN = {"t4": (32, 40, 7), "l4": (64, 21, 12)}
SETTINGS = (("S1 (T4)", "t4", None), ("S2 (L4)", "l4", None), ("RTX 4090, batch 1", "rtx4090", 1))
GEN = 32
PIPELINES = ("cgopipe", "klotski")  # the target (ratio <= 1.10) is for pipeline schedulers


def policy_for(name: str, setup: Setup, hw_name: str, batch: int | None) -> tuple[Policy | None, str]:
    """The planner's policy for `name` (None when nothing fits), and where it came from."""
    if batch is None and name == "cgopipe":
        plan = search(setup.spec, setup.hardware, setup.workload, max_batch=MTBENCH_REQUESTS)
        return plan.best.policy, "HRM plan"
    if batch is None and name == "flexgen":
        gbs, count, percent = FLEXGEN[hw_name]
        return Policy(gbs, count, weights_gpu_share=percent / 100, kv_gpu_share=0.0), "artifact's FlexGen"
    given = Given(batch_size=batch, micro_batches=1) if batch is not None else Given()
    result = best_policy(setup, name, given)
    return (None, result.error or "") if result.error is not None else (result.policy, "best fitting")


def run_row(label: str, hw_name: str, batch: int | None, name: str, steps: int, model: Any) -> dict[str, Any]:
    spec = preset("mixtral-8x7b")
    work = workload("mtbench").with_gen_len(GEN)
    setup = Setup(spec, hardware(hw_name), work, Policy(), RoutingModel(0.5, 0.3), decode_samples=2)
    policy, source = policy_for(name, setup, hw_name, batch)
    row: dict[str, Any] = {"setting": label, "hardware": hw_name, "scheduler": name, "policy_source": source}
    if policy is None:
        return {**row, "error": source}
    simulation = Simulation(evolve(setup, policy=policy, decode_samples=steps + 1))
    refusal = simulation.refusal(name)
    if refusal is not None and source != "best fitting":  # e.g. over the host's memory: the search's
        fallback = best_policy(setup, name, Given(batch_size=batch, micro_batches=1 if batch else None))
        if fallback.error is not None:
            return {**row, "error": fallback.error}
        policy, source = fallback.policy, f"best fitting ({source}: {refusal.error})"
        row["policy_source"] = source
        simulation = Simulation(evolve(setup, policy=policy, decode_samples=steps + 1))
        refusal = simulation.refusal(name)
    if refusal is not None:
        return {**row, "error": refusal.error}
    decode = simulation.steps[-steps:]  # the last decode steps sampled (longest context)
    run = realtime_run(simulation, name, decode, model=model)
    p = policy
    return {**row, "error": None,
            "policy": {"batch_size": p.batch_size, "micro_batch_size": p.micro_batch_size,
                       "micro_batches": p.micro_batches, "attention_on": p.attention_on, "ffn_on": p.ffn_on,
                       "weights_gpu_share": p.weights_gpu_share, "kv_gpu_share": p.kv_gpu_share},
            "nodes_per_step": len(run.trace.spans) / run.steps, **run.to_json()}  # fmt: skip


def table(label: str, rows: list[dict[str, Any]]) -> Table:
    t = Table(title=f"real-clock vs simulated decode steps ({label}), Mixtral-8x7B, {machine()}")
    for column in ("setting", "scheduler", "N (μ x n)", "nodes/step", "simulated s", "real-clock s", "ratio",
                   "host CPU s/step", "busiest host thread"):  # fmt: skip
        t.add_column(column, justify="right")
    for r in rows:
        if r["error"] is not None:
            t.add_row(
                r["setting"], r["scheduler"], "-", "-", "-", "-", "-", "-", f"[yellow]{r['error'][:60]}[/]"
            )
            continue
        p, host = r["policy"], r["host_seconds"]
        top = max(host, key=host.__getitem__)
        flag = "" if r["realtime_ratio"] <= 1.10 else " [red]>1.10[/]"
        shape = f"{p['batch_size']} ({p['micro_batch_size']} x {p['micro_batches']})"
        busiest = f"{top} {host[top] / r['realtime_steps']:.3f} s"
        t.add_row(
            r["setting"],
            r["scheduler"],
            shape,
            f"{r['nodes_per_step']:.0f}",
            f"{r['makespan_seconds']:.3f}",
            f"{r['realtime_makespan_seconds']:.3f}",
            f"{r['realtime_ratio']:.3f}{flag}",
            f"{r['host_seconds_per_step']:.3f}",
            busiest,
        )
    return t


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    return f"{os.cpu_count()}-vCPU shared VM ({cpu}), Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--label", default="latest", help="key the results are stored under in the JSON")
    parser.add_argument("--steps", type=int, default=1, help="decode steps run per row")
    parser.add_argument("--only", help="comma-separated schedulers (default: the five)")
    parser.add_argument("--out", type=Path, default=OUT, help="JSON file the results are merged into")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else SCHEDULERS
    model = meta_model(preset("mixtral-8x7b"))
    rows = []
    started = time.time()
    for label, hw_name, batch in SETTINGS:
        for name in names:
            with console.status(f"{label}: {name}"):
                rows.append(run_row(label, hw_name, batch, name, args.steps, model))
            console.log(f"{label} {name}: {rows[-1].get('realtime_ratio', rows[-1]['error'])}")
    console.print(table(args.label, rows))
    data = json.loads(args.out.read_text()) if args.out.exists() else {}
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started))
    data[args.label] = {"machine": machine(), "date": date, "steps_per_row": args.steps, "rows": rows}
    args.out.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
