"""How well the simulator predicts a real CPU run on this machine, after `flowmoe calibrate`.

1. Calibrate this machine (CPU only: the gpu.* lanes run on the CPU here).
2. Run a real batch through `flowmoe.runtime.runner.Runtime` (a preset with random weights, cut to a few
   layers), recording every step's shape and every gate's routing.
3. Simulate the same steps with the same scheduler, the calibrated profile and the recorded routing.
4. Compare per-lane busy time, per-op busy time and step makespans; report the relative errors.

Prints rich tables and writes bench/sim_accuracy.json.

    python bench/sim_accuracy.py [--model olmoe-1b-7b --layers 2 --schedulers eager,cgopipe]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from attrs import define
from rich.console import Console
from rich.table import Table

from flowmoe.core.cost import RooflineCost
from flowmoe.core.executor import Span
from flowmoe.core.hardware import HardwareSpec, save_profile
from flowmoe.core.policy import Policy
from flowmoe.core.presets import PRESETS, preset
from flowmoe.core.routing_trace import RoutingTrace
from flowmoe.core.scheduling import NodeFactory, SchedulerContext, StepShape
from flowmoe.core.workloads import workload
from flowmoe.jobs.engine import Engine, Request, StepInput, StepRunner
from flowmoe.model.loading import load_model
from flowmoe.model.moe_model import MoEModel
from flowmoe.runtime.runner import Runtime, step_shape
from flowmoe.schedulers.registry import create
from flowmoe.study.calibrate import Shapes, calibrate
from flowmoe.study.simulate import run_steps

console = Console()
OUT = Path(__file__).with_suffix(".json")


@define
class Measured:
    shapes: list[StepShape]
    routing: RoutingTrace
    repeats: list[tuple[list[float], list[Span]]]  # per measured batch: step wall times, spans


def real_run(model: MoEModel, name: str, policy: Policy, prompts: Sequence[int], gen: int, hw: HardwareSpec,
             repeats: int) -> Measured:  # fmt: skip
    """A warm-up batch, then `repeats` measured batches (same prompts, greedy: the same routing)."""
    runtime = Runtime.create(model, name, policy, "cpu", RooflineCost(hw))
    shapes: list[StepShape] = []
    walls: list[float] = []

    async def recording(m: MoEModel, inputs: Sequence[StepInput]) -> list[torch.Tensor]:
        shapes.append(step_shape(len(walls), inputs))
        started = time.perf_counter()
        out = await runtime(m, inputs)
        walls.append(time.perf_counter() - started)
        return out

    def batch(runner: StepRunner) -> None:
        engine = Engine(model, runner, max_new_tokens=gen, cache_device=runtime.cache_device)
        requests = [
            Request(str(i), tuple(3 + (7 * i + j) % 200 for j in range(n)), i) for i, n in enumerate(prompts)
        ]
        mu = policy.micro_batch_size
        groups = [requests[i : i + mu] for i in range(0, len(requests), mu)]

        async def go() -> None:
            async for _ in engine.run_batch([engine.micro_batch(i, g) for i, g in enumerate(groups)]):
                pass

        asyncio.run(go())

    measured = Measured([], RoutingTrace(), [])
    try:
        batch(runtime)  # warm-up: allocations, first touch of the weights
        for repeat in range(repeats):
            runtime.trace.spans.clear()
            runtime.steps, runtime.routing = 0, RoutingTrace()
            shapes.clear()
            walls.clear()
            batch(recording)
            measured.repeats.append((list(walls), list(runtime.trace.spans)))
            if repeat == 0:
                measured.shapes.extend(shapes)
                measured.routing = runtime.routing
    finally:
        runtime.close()
    return measured


def busy(spans: Sequence[Span], key: Callable[[Span], str]) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for span in spans:
        out[key(span)] += span.end - span.start
    return dict(out)


def figures(walls: list[float], spans: Sequence[Span]) -> dict[str, float]:
    """Whole batch, prefill, decode, per-lane and per-op busy seconds."""
    out = {
        "whole batch (wall)": sum(walls),
        "prefill step (wall)": walls[0],
        "decode steps (wall)": sum(walls[1:]),
    }
    out |= {f"lane {k}": v for k, v in busy(spans, lambda s: str(s.node.lane)).items()}
    return out | {f"  op {k}": v for k, v in busy(spans, lambda s: str(s.node.op)).items()}


def compare(name: str, model: MoEModel, policy: Policy, prompts: list[int], gen: int, hw: HardwareSpec,
            repeats: int) -> dict[str, Any]:  # fmt: skip
    measured = real_run(model, name, policy, prompts, gen, hw, repeats)
    scheduler = create(name, SchedulerContext(model.spec, policy, NodeFactory(model.spec), RooflineCost(hw)))
    runs = run_steps(scheduler, measured.shapes, measured.routing, RooflineCost(hw))
    simulated = figures([r.seconds for r in runs], [s for r in runs for s in r.spans])
    real = [figures(walls, spans) for walls, spans in measured.repeats]
    rows = {}
    for key in sorted(set(simulated).union(*real), key=_order):
        values = [r.get(key, 0.0) for r in real]
        rows[key] = {"real": statistics.median(values), "real_min": min(values), "real_max": max(values),
                     "simulated": simulated.get(key, 0.0)}  # fmt: skip
    return {"scheduler": name, "steps": len(measured.shapes), "repeats": repeats, "rows": rows}


def _order(key: str) -> tuple[int, str]:
    return (0 if "wall" in key else 1 if key.startswith("lane") else 2, key)


def error(pair: dict[str, float]) -> float:
    return (pair["simulated"] - pair["real"]) / pair["real"] if pair["real"] else 0.0


def table(result: dict[str, Any]) -> Table:
    name, repeats, steps = result["scheduler"], result["repeats"], result["steps"]
    title = f"{name}: real CPU run (median of {repeats}) vs simulation, {steps} steps"
    t = Table(title=title)
    for column in ("what", "real s", "real range", "simulated s", "error"):
        t.add_column(column, justify="right")
    for what, row in result["rows"].items():
        spread = f"{row['real_min']:.3f}-{row['real_max']:.3f}"
        t.add_row(what, f"{row['real']:.3f}", spread, f"{row['simulated']:.3f}", f"{error(row):+.1%}")
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="olmoe-1b-7b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--schedulers", default="eager,cgopipe,fiddler")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--gen-len", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3, help="measured batches per scheduler (median)")
    parser.add_argument("--quick", action="store_true", help="quick calibration")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads per op, calibration and runs alike"
    )
    args = parser.parse_args()
    load_before = os.getloadavg()
    torch.set_num_threads(args.threads)
    with console.status("calibrating this machine"):
        shapes = Shapes.of(preset(args.model)) if args.model in PRESETS else None
        hw, _measured = calibrate(quick=args.quick, device="cpu", shapes=shapes)
    save_profile(hw, OUT.with_name("sim_accuracy_profile.json"))
    with console.status(f"loading {args.model} ({args.layers} layers, random weights)"):
        model = load_model(args.model, "float32", args.layers)
    prompts = workload("mtbench").sample(args.batch_size, seed=0)
    mu = -(-args.batch_size // args.micro_batches)
    policy = Policy(mu, args.micro_batches, "cpu", weights_gpu_share=0.0, cpu_threads=args.threads)
    results = []
    for name in args.schedulers.split(","):
        with console.status(f"{name}: real run, then simulation"):
            results.append(compare(name, model, policy, prompts, args.gen_len, hw, args.repeats))
        console.print(table(results[-1]))
    data = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "torch_threads": args.threads, "load_before": load_before,
                    "load_after": os.getloadavg()},
        "model": args.model, "layers": args.layers, "prompts": prompts, "gen_len": args.gen_len,
        "policy": {"micro_batch_size": mu, "micro_batches": args.micro_batches},
        "profile": str(OUT.with_name("sim_accuracy_profile.json").name),
        "results": results,
    }  # fmt: skip
    tmp = OUT.with_name(f".{OUT.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, OUT)
    console.print(f"wrote {OUT} (load average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
