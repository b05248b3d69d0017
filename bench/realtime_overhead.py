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
    python bench/realtime_overhead.py --h200 [--steps 3]

`--h200` (issue 29, item 4: the regression benchmark of the host's launches) runs the H200 GPU run's
setting instead (../shared/gpu-runs/2026-11-27-h200: cgopipe, Mixtral-8x7B x12 layers, 32 prompts of
~128 tokens, 16 new tokens, 4 micro-batches, 25% of experts resident, 16 GiB, `h200` preset) on the real
clock with the launch costs measured on that run (`flowmoe.study.realtime.LaunchCosts`, torch
operations per node from bench/step_counts.json: re-run that bench after cutting operations) and
without them, and prints the predicted host seconds per decode step next to the step's link time
and the measured 0.79 s (measured on the code before item 3's cuts: a reference, not a check).
`--threads JSONL` (with --h200): a bench/gpu.py --out of a GPU run of this code, whose cgopipe t4 row
carries the per-thread CPU record; the threads outside the stack are charged from it per GPU node, the
prediction is compared with that run's process CPU per decode step, role by role (main, lanes, other),
each thread's waits for the device replayed on the simulated steps
(`flowmoe.study.realtime.replay_host`: the LM head's read-back, at 8fcf0a3 the gates' too, the
driver's, the run-ahead bound) and counted as CPU where CUDA spins through them: at 8fcf0a3 (spin,
events not blocking), now (blocking events), now with the compute lane's run-ahead bound (`--run-ahead
N`, devices/cuda.py), and under `cudaDeviceScheduleBlockingSync`.

Prints a rich table; results go into bench/realtime_overhead.json under the label (other labels
are kept, so a baseline and a later run sit side by side).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import Counter
from pathlib import Path
from statistics import median
from typing import Any

from attrs import asdict, evolve
from launch_stats import H200_TRACE, LaunchStats, read_trace_gz, readback_us, trace_steps
from rich.console import Console
from rich.table import Table

from flowmoe.core.bounded_read import CONFIG, read_bounded
from flowmoe.core.cost import RooflineCost
from flowmoe.core.hardware import hardware
from flowmoe.core.plan import Lane, Op
from flowmoe.core.policy import Policy, parse_bytes
from flowmoe.core.policy_search import search
from flowmoe.core.presets import preset
from flowmoe.core.synthetic_routing import RoutingModel
from flowmoe.core.thread_cpu import role
from flowmoe.core.workloads import workload
from flowmoe.devices.cuda import DEFAULT_RUN_AHEAD
from flowmoe.devices.realclock import NOW, RUN4, SYNCS_AT_8FCF0A3, DeviceWaits, WaitMode, Waits
from flowmoe.kernels.native import cpuinfo_field
from flowmoe.study.best_policy import Given, best_policy
from flowmoe.study.realtime import (
    NO_LAUNCH,
    NODE_SECONDS,
    OP_SECONDS,
    LaunchCosts,
    meta_model,
    ops_per_node,
    other_seconds_per_node,
    realtime_run,
    replay_host,
    split_spins,
)
from flowmoe.study.sim_report import RealtimeRun
from flowmoe.study.simulate import Setup, Simulation, run_steps
from flowmoe.traces.chrome import chrome_trace

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


H200_HOST_MEASURED = (
    0.7918  # s/step: `trace summarize` of t4-cgopipe-trace.json.gz (its 15 decode steps: 0.760)
)
H200_LINK_MEASURED = 0.465  # s: 25.4 GB per decode step / 54.6 GB/s (the run's README)
COUNTS = Path(__file__).with_name("step_counts.json")


def counted_ops(path: Path = COUNTS) -> dict[Op, float]:
    """Torch operations per node by kind, cgopipe at the H200 setting, from bench/step_counts.json as
    it is now (flowmoe.study.realtime.H200_OPS; re-run bench/step_counts.py after a cut)."""
    data = json.loads(read_bounded(path, CONFIG).decode())
    return ops_per_node(
        next(r for r in data["rows"] if r["scheduler"] == "cgopipe" and r["setting"].startswith("H200"))
    )


def thread_record(path: Path) -> tuple[dict[str, Any], float]:
    """The per-thread CPU record of the cgopipe row of a bench/gpu.py --out file (the H200 setting,
    budget t4) and that row's nodes per decode step; one line and exit 2 where it holds none."""
    rows = [json.loads(line) for line in read_bounded(path, CONFIG).decode().splitlines() if line.strip()]
    row = next((r for r in rows if r.get("kind") == "row" and r.get("scheduler") == "cgopipe"
                and r.get("budget") == "t4" and r.get("thread_cpu")), None)  # fmt: skip
    if row is None:
        print(f"{path}: no cgopipe t4 row with a per-thread record (thread_cpu): not a bench/gpu.py --out "
              "file of this version", file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    return row["thread_cpu"], row["nodes_per_decode_step"]


def own_costs(run: RealtimeRun) -> tuple[float, float]:
    """What the real clock itself spends, on this machine, on the events a launch charge stands for:
    its lane threads' host seconds per GPU node (the least over its GPU lanes), and its median from a
    gate's end to the first expert FFN queued (bench/launch_stats.py on its own trace)."""
    nodes = Counter(str(s.node.lane) for s in run.trace.spans if s.node.lane.on_gpu)
    per_node = min(run.host_seconds[lane] / count for lane, count in nodes.items())
    return per_node, median(readback_us(trace_steps(chrome_trace([run.trace]), decode_only=False))) / 1e6


def h200_costs(h200: LaunchStats, own: tuple[float, float], ops: dict[Op, float]) -> dict[str, LaunchCosts]:
    """The launch costs compared: the span fit alone (before), with the worker's gaps, waits, evicts
    and read-backs net of what the real clock runs for real (`own`), and all of them in full."""
    spans = evolve(NO_LAUNCH, op_seconds=OP_SECONDS, node_seconds=NODE_SECONDS, ops=ops)
    full = evolve(spans, node_gap_seconds=h200.node_gap_us / 1e6,
                  wait_seconds=max(0.0, h200.wait_gap_us) / 1e6, evict_seconds=h200.evict_span_us / 1e6,
                  readback_seconds=h200.readback_us / 1e6)  # fmt: skip
    per_node, readback = own
    net = evolve(full, node_gap_seconds=max(0.0, full.node_gap_seconds - per_node),
                 readback_seconds=max(0.0, full.readback_seconds - readback))  # fmt: skip
    return {"net of the real clock's own": net, "all in full (upper bound)": full,
            "spans only (before)": spans}  # fmt: skip


NO_WAITS = DeviceWaits(syncs={})  # the real clock before it modelled the CUDA worker's waits
AT_8FCF0A3 = DeviceWaits(syncs=SYNCS_AT_8FCF0A3)  # the waits of the code the H200 run 4 ran
NOTHING_SPINS = WaitMode(spin=False)


def h200_rows(
    steps: int, ops: dict[Op, float], other: float = 0.0, run_ahead: int = DEFAULT_RUN_AHEAD
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The H200 run's setting on the real clock: without launch costs, then with each set compared
    (`ops`: torch operations per node by kind). Where a per-thread record gave `other` (CPU seconds
    per GPU node of threads outside the stack), the net set with it: with the CUDA worker's waits of
    8fcf0a3 (the code the GPU run ran: a gate's bincount read-back; every wait spun), with today's
    waits and the run-ahead bound, and without waits (the rows before); else the sets alone, no waits."""
    spec = preset("mixtral-8x7b", layers=12)
    setup = Setup(spec, hardware("h200"), workload("fixed:128:16"), Policy(), RoutingModel(0.5, 0.3))
    given = Given(32, 4, "gpu", None, 0.25, None, parse_bytes("16GiB"))
    result = best_policy(setup, "cgopipe", given)
    assert result.policy is not None, result.error
    simulation = Simulation(evolve(setup, policy=result.policy, decode_samples=steps + 1))
    decode = simulation.steps[-steps:]
    model = meta_model(spec)
    cost = RooflineCost(setup.hardware, spec)
    h200 = LaunchStats.of(trace_steps(read_trace_gz(H200_TRACE)))

    def row(
        label: str, launch: LaunchCosts, waits: DeviceWaits = NO_WAITS, mode: WaitMode = NOTHING_SPINS
    ) -> tuple[dict[str, Any], RealtimeRun]:
        run = realtime_run(simulation, "cgopipe", decode, model=model, launch=launch, waits=waits, mode=mode)
        charged = launch.charge([s.node for s in run.trace.spans]) / run.steps
        lanes = {k: v / run.steps for k, v in run.host_seconds.items()}
        link = sum(cost(s.node) for s in run.trace.spans if s.node.lane == Lane.GPU_H2D) / run.steps
        return {"label": label, "charged_s_per_step": charged, "lanes_s_per_step": lanes,
                "link_s_per_step": link, "launch": costs_json(launch),
                "waits": {"syncs": {str(k): v for k, v in waits.syncs.items()}, "run_ahead": waits.run_ahead},
                **run.to_json()}, run  # fmt: skip

    first, alone = row("host stack only", NO_LAUNCH)
    own = own_costs(alone)
    costs = h200_costs(h200, own, ops)
    sets: list[tuple[str, LaunchCosts, DeviceWaits, WaitMode]] = []
    if other:
        net = evolve(costs["net of the real clock's own"], other_seconds=other)
        sets = [("+ other threads, the worker's waits at 8fcf0a3", net, AT_8FCF0A3, RUN4),
                (f"+ other threads, waits now, run-ahead {run_ahead}", net, DeviceWaits(run_ahead=run_ahead),
                 NOW),
                ("+ other threads, no waits (before)", net, NO_WAITS, NOTHING_SPINS)]  # fmt: skip
    else:
        sets = [(label, launch, NO_WAITS, NOTHING_SPINS) for label, launch in costs.items()]
    rows = [row(*s)[0] for s in sets]
    sources = {"h200_trace": str(H200_TRACE.name), "h200": h200.to_json(),
               "own_host_s_per_gpu_node": own[0], "own_gate_to_expert_queued_s": own[1]}  # fmt: skip
    if other:  # the waits replayed on the simulated timeline, the H200 host's costs per node
        virtual = run_steps(
            simulation.scheduler("cgopipe", simulation.popularity), decode, simulation.trace, cost
        )
        full = costs["all in full (upper bound)"]
        sources["replayed"] = {"8fcf0a3": replayed(virtual, full, AT_8FCF0A3),
                               **{str(bound): replayed(virtual, full, DeviceWaits(run_ahead=bound))
                                  for bound in (0, run_ahead)}}  # fmt: skip
    return [*rows, first], sources


def replayed(virtual: list[Any], launch: LaunchCosts, waits: DeviceWaits) -> dict[str, Any]:
    """`replay_host` over the simulated steps `virtual`: per step, the waits by "thread waits on what",
    the charged host seconds by thread, and the step's time with the launches in it."""
    runs = [replay_host(r.spans, launch, waits) for r in virtual]
    per_step: dict[str, float] = {}
    for r in runs:
        for (thread, on), seconds in r.waits.items():
            key = f"{thread} on {on}"
            per_step[key] = per_step.get(key, 0.0) + seconds / len(runs)
    busy = {k: sum(r.busy.get(k, 0.0) for r in runs) / len(runs) for k in runs[0].busy}
    return {"waits_s_per_step": per_step, "busy_s_per_step": busy,
            "step_s": sum(r.seconds for r in runs) / len(runs),
            "simulated_step_s": sum(v.seconds for v in virtual) / len(virtual)}  # fmt: skip


def waits_of(replay: dict[str, Any]) -> Waits:
    """A `replayed` summary's waits back as (thread, what it waited on) -> seconds per step."""
    out: Waits = {}
    for key, seconds in replay["waits_s_per_step"].items():
        thread, _, on = key.rpartition(" on ")
        out[(thread, on)] = seconds
    return out


def costs_json(launch: LaunchCosts) -> dict[str, float]:
    """The per-event charges of `launch` (seconds; per-operation counts apart)."""
    return {k: v for k, v in asdict(launch).items() if isinstance(v, float)}


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


def h200_main(
    label: str, steps: int, out: Path, threads: Path | None, run_ahead: int = DEFAULT_RUN_AHEAD
) -> None:
    """The code as it is now (its plan, its operations per node from bench/step_counts.json) on the
    real clock. Without `threads`: against the H200 run's 0.79 s, measured on the code before issue 29
    item 3's cuts (a reference, not a check). With `threads` (a bench/gpu.py --out of a run of this
    code, its rows carrying per-thread records): against that run's process CPU per decode step, the
    threads outside the stack charged from its record, each role beside what that run measured."""
    started = time.time()
    record, nodes = thread_record(threads) if threads is not None else ({}, 0.0)
    other = other_seconds_per_node(record, nodes) if record else 0.0
    target = record["process_cpu_s_per_step"] if record else H200_HOST_MEASURED
    rows, sources = h200_rows(steps, counted_ops(), other, run_ahead)
    t = Table(title=f"H200 run's setting on the real clock ({label}), {machine()}")
    for column in ("launches", "host s/decode step", "of it charged", f"vs measured {target:.2f} s",
                   "link s/step", "host / link", "real-clock s/step", "busiest host thread"):  # fmt: skip
        t.add_column(column, justify="right")
    for r in rows:
        host, lanes = r["host_seconds_per_step"], r["lanes_s_per_step"]
        top = max(lanes, key=lanes.__getitem__)
        link, wall = r["link_s_per_step"], r["realtime_makespan_seconds"] / r["realtime_steps"]
        t.add_row(r["label"], f"{host:.3f}", f"{r['charged_s_per_step']:.3f}",
                  f"{host / target:.2f}", f"{link:.3f}", f"{host / link:.2f}", f"{wall:.3f}",
                  f"{top} {lanes[top]:.3f} s")  # fmt: skip
    console.print(t)
    if record:
        console.print(by_role(rows, record, sources["replayed"]))
        for bound, replay in sources["replayed"].items():
            console.print(f"replayed, run-ahead {bound} (0: unbounded): {replay}")
    where = f"the run of {threads} (its process CPU)" if record else "the H200 run, code before the cuts"
    console.print(
        f"measured on {where}: host {target:.3f} s/step; the H200 run's link {H200_LINK_MEASURED} s/step"
    )
    console.print(
        f"per event, from {sources['h200_trace']}: {sources['h200']}; the real clock's own here: "
        f"{sources['own_host_s_per_gpu_node'] * 1e6:.1f} us host per GPU node, "
        f"{sources['own_gate_to_expert_queued_s'] * 1e6:.1f} us gate end to first expert queued"
    )
    for r in rows:
        console.print(f"{r['label']}: " + ", ".join(f"{k} {v * 1e6:.2f} us" for k, v in r["launch"].items()))
    data = json.loads(out.read_text()) if out.exists() else {}
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started))
    measured = {"host_s_per_step": target, "link_s": H200_LINK_MEASURED, "thread_record": record,
                "record_from": str(threads) if threads else None}  # fmt: skip
    data[f"h200:{label}"] = {"machine": machine(), "date": date, "steps_per_row": steps, "rows": rows,
                             "measured": measured, "per_event": sources}  # fmt: skip
    out.write_text(json.dumps(data, indent=1) + "\n")


def roles(host: dict[str, float], spun: dict[str, float]) -> dict[str, float]:
    """CPU s per decode step by role: a real-clock row's threads' host work (`host`: its seconds per
    step, its own waits left out) plus the seconds each thread spins (`spun`): main, lanes, other,
    the process, and "spinning" (of it)."""
    cpu, _ = split_spins(host)
    out = {"main": 0.0, "lanes": 0.0, "other": 0.0}
    for thread, seconds in [*cpu.items(), *spun.items()]:
        out["main" if thread == "main" else "other" if thread == "other threads" else "lanes"] += seconds
    return {**out, "process": sum(out.values()), "spinning": sum(spun.values())}


def by_role(rows: list[dict[str, Any]], record: dict[str, Any], replays: dict[str, Any]) -> Table:
    """CPU s per decode step by role: the GPU run's per-thread record (its flowmoe-* threads as
    "lanes", the rest "other", exited threads apart) beside the real clock's rows (the first with
    8fcf0a3's waits, the second with today's and the run-ahead bound, the third without waits), each
    thread's spinning from the waits replayed on the simulated timeline (`replay_host`): 8fcf0a3's
    code and wait mode (CUDA's default spin, events not blocking), today's code (the gate's counts
    without a read-back, blocking events) unbounded and bounded, `cudaDeviceScheduleBlockingSync`
    (nothing spins)."""
    measured = {"main": 0.0, "lanes": 0.0, "other": other_seconds_per_node(record, 1.0)}
    for group, seconds in record["thread_cpu_s_per_step"].items():
        if role(group) != "other":
            measured[role(group)] += seconds
    measured |= {"process": record["process_cpu_s_per_step"], "spinning": float("nan")}
    waits, bounded, before = (r["lanes_s_per_step"] for r in rows[:3])
    then, free, bound = (waits_of(replays[k]) for k in replays)
    columns = {"real clock, 8fcf0a3 (spin)": roles(waits, RUN4.spun(then)),
               "now, unbounded": roles(bounded, NOW.spun(free)),
               f"now + run-ahead {list(replays)[2]}": roles(bounded, NOW.spun(bound)),
               "BlockingSync": roles(waits, {}), "no waits (before)": roles(before, {})}  # fmt: skip
    t = Table(title="CPU s per decode step by role: the GPU run's per-thread record vs the real clock")
    for column in ("role", "GPU run (8fcf0a3)", *columns, "8fcf0a3 / GPU run"):
        t.add_column(column, justify="right")
    for name in ("main", "lanes", "other", "process", "spinning"):
        first = columns["real clock, 8fcf0a3 (spin)"][name]
        ratio = (
            f"{first / measured[name]:.2f}" if measured[name] == measured[name] and measured[name] else "-"
        )
        t.add_row(name, f"{measured[name]:.3f}", *(f"{c[name]:.3f}" for c in columns.values()), ratio)
    return t


def machine() -> str:
    cpu = cpuinfo_field("model name") or platform.processor() or platform.machine()
    return f"{os.cpu_count()}-vCPU shared VM ({cpu}), Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--label", default="latest", help="key the results are stored under in the JSON")
    parser.add_argument("--steps", type=int, default=1, help="decode steps run per row")
    parser.add_argument("--only", help="comma-separated schedulers (default: the five)")
    parser.add_argument("--out", type=Path, default=OUT, help="JSON file the results are merged into")
    parser.add_argument("--h200", action="store_true", help="the H200 run's setting: predicted host per step")
    parser.add_argument("--threads", type=Path, metavar="JSONL", help="with --h200: a bench/gpu.py --out "
                        "whose cgopipe t4 row carries a per-thread CPU record (thread_cpu): predict that "
                        "run's host time, the code as it is now")  # fmt: skip
    parser.add_argument("--run-ahead", type=int, default=DEFAULT_RUN_AHEAD, help="with --threads: the "
                        "bound on the compute lane's launches compared (devices/cuda.py "
                        "FLOWMOE_CUDA_RUN_AHEAD)")  # fmt: skip
    args = parser.parse_args()
    if args.threads is not None and not args.h200:
        parser.error("--threads goes with --h200")
    if args.h200:
        h200_main(args.label, args.steps, args.out, args.threads, args.run_ahead)
        return
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
