"""`flowmoe simulate` and `flowmoe compare`: schedulers on the SimWorker at paper scale, on any machine.

Both run a batch of the workload through the real schedulers under the
roofline cost of a hardware spec, with routing from a recorded trace or a
synthetic one; `compare` writes one Chrome trace with a process group per
scheduler (stacked in Perfetto). The policy is the HRM plan's unless
--batch-size is given.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from attrs import evolve
from rich.table import Table

from flowmoe.cli.plan import add_setup_flags, spec_from, workload_from
from flowmoe.cli.ui import console, out
from flowmoe.core.errors import ConfigError
from flowmoe.core.hardware import hardware
from flowmoe.core.policy import Policy, parse_bytes
from flowmoe.core.policy_search import search
from flowmoe.core.routing_trace import RoutingTrace
from flowmoe.core.synthetic_routing import RoutingModel
from flowmoe.schedulers.registry import available
from flowmoe.study.sim_report import SimulationResult
from flowmoe.study.simulate import Setup, simulate_workload
from flowmoe.traces.chrome import write_chrome

LANES = ("gpu.compute", "cpu.compute", "gpu.h2d", "gpu.d2h")


def register(sub: argparse._SubParsersAction) -> None:
    simulate = sub.add_parser("simulate", help="simulate schedulers on a workload batch at paper scale")
    _flags(simulate)
    simulate.add_argument("--scheduler", default="all", help="a scheduler name, or all")
    simulate.add_argument("--trace", type=Path, help="write the simulated steps as a Chrome trace")
    simulate.add_argument("--json", action="store_true", help="print the results as one JSON object")
    simulate.set_defaults(handler=_simulate)
    compare = sub.add_parser("compare", help="several schedulers on one setup: one stacked trace and a table")
    _flags(compare)
    compare.add_argument("--schedulers", help="comma-separated names (default: every registered one)")
    compare.add_argument("--trace", type=Path, default=Path("compare.json"), help="Chrome trace to write")
    compare.add_argument("--json", action="store_true", help="print the results as one JSON object")
    compare.set_defaults(handler=_compare)


def _flags(parser: argparse.ArgumentParser) -> None:
    add_setup_flags(parser)
    policy = parser.add_argument_group("policy (default: the HRM plan's)")
    policy.add_argument("--batch-size", type=int, help="N sequences in the batch")
    policy.add_argument("--micro-batches", type=int, default=1)
    policy.add_argument("--attention-on", choices=("gpu", "cpu"), default="gpu")
    policy.add_argument("--ffn-on", choices=("gpu", "cpu"), default="gpu")
    policy.add_argument("--weights-gpu-share", type=float, default=0.0)
    policy.add_argument("--kv-gpu-share", type=float, default=1.0)
    policy.add_argument("--gpu-memory", help="GPU memory budget (default: the hardware's)")
    routing = parser.add_argument_group("routing")
    routing.add_argument(
        "--routing", type=Path, help="routing trace recorded by `flowmoe run --record-routing`"
    )
    routing.add_argument("--skew", type=float, default=0.5, help="Zipf exponent of expert popularity")
    routing.add_argument("--correlation", type=float, default=0.3, help="layer-to-layer routing correlation")
    routing.add_argument("--pregate-accuracy", type=float, default=0.9)
    routing.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decode-samples", type=int, default=4, help="decode steps simulated (0: all)")


def setup_from(args: argparse.Namespace) -> Setup:
    spec, hw, work = spec_from(args), hardware(args.hardware), workload_from(args)
    if args.batch_size is None:
        policy = search(spec, hw, work).best.policy
    else:
        if args.batch_size < 1 or args.micro_batches < 1:
            raise ConfigError("--batch-size and --micro-batches must be at least 1")
        policy = Policy(
            micro_batch_size=-(-args.batch_size // args.micro_batches), micro_batches=args.micro_batches,
            attention_on=args.attention_on, ffn_on=args.ffn_on, weights_gpu_share=args.weights_gpu_share,
            kv_gpu_share=args.kv_gpu_share,
        )  # fmt: skip
    if args.gpu_memory:
        policy = evolve(policy, gpu_memory=parse_bytes(args.gpu_memory))
    recorded = _recorded(args.routing) if args.routing else None
    model = RoutingModel(args.skew, args.correlation, args.pregate_accuracy, args.seed)
    return Setup(spec, hw, work, policy, model, recorded, args.decode_samples, args.seed)


def _recorded(path: Path) -> RoutingTrace:
    if not path.is_file():
        raise ConfigError(f"{path}: routing trace not found")
    return RoutingTrace.load(path)


def _names(requested: str | None) -> list[str]:
    names = list(available())
    if requested in (None, "all"):
        return names
    chosen = [n.strip() for n in requested.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in names]
    if unknown or not chosen:
        raise ConfigError(
            f"unknown scheduler {unknown[0] if unknown else requested!r}; available: {', '.join(names)}"
        )
    return chosen


def _simulate(args: argparse.Namespace) -> int:
    return _report(args, setup_from(args), _names(args.scheduler))


def _compare(args: argparse.Namespace) -> int:
    return _report(args, setup_from(args), _names(args.schedulers))


def _report(args: argparse.Namespace, setup: Setup, names: list[str]) -> int:
    with console.status(f"simulating {', '.join(names)}"):
        results = simulate_workload(setup, names)
    traces = [r.trace for r in results if r.trace is not None]
    if args.trace and traces:
        write_chrome(args.trace, traces)
    if args.json:
        print(json.dumps(results_json(setup, results)))
        return 0
    out.print(results_table(setup, results))
    for r in results:
        if r.error is not None:
            out.print(f"[yellow]{r.scheduler}[/]: {r.error}", soft_wrap=True)
    if len(results) == 1 and results[0].error is None:
        out.print(lanes_table(results[0]))
    if args.trace and traces:
        out.print(f"trace: {args.trace} ({len(traces)} process groups; open in https://ui.perfetto.dev)")
    return 0


def results_table(setup: Setup, results: list[SimulationResult]) -> Table:
    p, work = setup.policy, setup.workload
    title = (f"simulated: {setup.spec.name} on {setup.hardware.name}, {work.name} gen {work.gen_len}, "
             f"N={p.batch_size} (μ={p.micro_batch_size} x {p.micro_batches}), attention {p.attention_on}, "
             f"FFN {p.ffn_on}")  # fmt: skip
    table = Table(title=title)
    for column in (
        "scheduler",
        "tokens/s",
        "vs best",
        "prefill s",
        "decode s",
        *LANES,
        "busiest",
        "its bubbles s",
    ):
        table.add_column(column, justify="right")
    best = max((r.throughput for r in results), default=0.0)
    for r in sorted(results, key=lambda r: -r.throughput):
        if r.error is not None:
            table.add_row(r.scheduler, "-", "-", "-", "-", *("-" for _ in LANES), "[yellow]see below[/]", "-")
            continue
        util = {lane.lane: r.utilisation(lane) for lane in r.lanes}
        busiest = max(r.lanes, key=lambda lane: lane.busy_seconds)
        table.add_row(r.scheduler, f"{r.throughput:.1f}", f"{r.throughput / best:.2f}" if best else "-",
                      f"{r.prefill_seconds:.1f}", f"{r.decode_seconds:.1f}",
                      *(f"{util[lane]:.0%}" if lane in util else "-" for lane in LANES), busiest.lane,
                      f"{busiest.bubble_seconds:.2f}")  # fmt: skip
    table.caption = (
        "utilisation = lane busy time / (prefill + decode); throughput = generated tokens / that time; "
        "bubbles = time the busiest lane sat idle with its next node queued, waiting on dependencies"
    )
    return table


def lanes_table(result: SimulationResult) -> Table:
    table = Table(title=f"{result.scheduler}: lanes over the whole batch")
    for column in ("lane", "busy s", "utilisation", "bubbles s"):
        table.add_column(column, justify="right")
    for lane in result.lanes:
        table.add_row(lane.lane, f"{lane.busy_seconds:.2f}", f"{result.utilisation(lane):.1%}",
                      f"{lane.bubble_seconds:.2f}")  # fmt: skip
    return table


def results_json(setup: Setup, results: list[SimulationResult]) -> dict[str, Any]:
    return {
        "model": setup.spec.name, "hardware": setup.hardware.name, "workload": setup.workload.name,
        "gen_len": setup.workload.gen_len, "decode_samples": setup.decode_samples,
        "results": [r.to_json() for r in results],
    }  # fmt: skip
