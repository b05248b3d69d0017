"""The real-clock simulation (`flowmoe simulate --realtime`): the real host stack of a GPU run at
paper scale, every device action replaced by waiting the cost model's duration.

What runs for real: the scheduler (`Runtime.run_plan` on the simulation's scheduler), the driver,
the executor, one thread per lane (`RealClockWorker`), the runtime's counters and trace, and the
weight-residency bookkeeping of PAGE_COPY and EVICT (`DeviceWeights` over a model whose weights are
torch `meta` tensors: shapes and bytes, no storage). The tensor math of the other nodes is what
the wait stands for; routing is answered from the simulation's routing (a trace or synthetic).
The virtual-clock makespan of the same steps comes next to the wall clock's, so their ratio is
what the host stack costs a GPU run that the simulator does not see.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import torch
from attrs import evolve

from flowmoe.core.cost import RooflineCost
from flowmoe.core.executor import Action
from flowmoe.core.plan import Lane, Op, TaskNode
from flowmoe.core.scheduling import StepShape
from flowmoe.core.spec import ModelSpec
from flowmoe.devices.realclock import RealClockWorker
from flowmoe.model.checkpoint import TORCH_DTYPES
from flowmoe.model.moe_model import MoEModel
from flowmoe.model.tensor_map import Shape, TensorMap
from flowmoe.runtime.actions import StepState
from flowmoe.runtime.device_weights import Devices, DeviceWeights
from flowmoe.runtime.runner import Runtime
from flowmoe.study.sim_report import RealtimeRun, SimulationResult
from flowmoe.study.simulate import Setup, Simulation, run_steps
from flowmoe.traces.trace import Trace

T = TypeVar("T")
Runner = Callable[[Coroutine[Any, Any, T]], T]

BOOKKEEPING = frozenset({Op.PAGE_COPY, Op.EVICT})  # actions that run for real, on meta weights
META = torch.device("meta")


class MetaSource:
    """Every tensor of the per-expert layout as a `meta` tensor: real shapes and bytes, no data."""

    def __init__(self, spec: ModelSpec) -> None:
        self._dtype = TORCH_DTYPES[spec.dtype]

    def has(self, name: str) -> bool:
        return not name.endswith("experts.gate_up_proj")

    def get(self, name: str, shape: Shape) -> torch.Tensor:
        return torch.empty(shape, dtype=self._dtype, device=META)


def meta_model(spec: ModelSpec) -> MoEModel:
    """The model at its real shapes with every weight on the meta device (Mixtral-8x7B: < 1 s)."""
    source, tensor_map = MetaSource(spec), TensorMap.for_spec(spec)
    layers = [tensor_map.load_layer(layer, source) for layer in range(spec.layers)]
    return MoEModel.build(spec, tensor_map.load_top(source, layers))


def realtime_run(
    simulation: Simulation,
    name: str,
    steps: Sequence[StepShape] | None = None,
    runner: Runner = asyncio.run,
    model: MoEModel | None = None,
) -> RealtimeRun:
    """Scheduler `name` over `steps` (default: the simulation's) on the real clock, next to the same
    steps on the virtual clock. `runner` runs the coroutine (the CLI passes uvloop's)."""
    setup = simulation.setup
    steps = list(simulation.steps if steps is None else steps)
    cost = RooflineCost(setup.hardware, setup.spec)
    routing = simulation.trace
    virtual = run_steps(simulation._scheduler(name, simulation.popularity), steps, routing, cost)
    scheduler = simulation._scheduler(name, simulation.popularity)  # fresh: schedulers keep state
    model = model or meta_model(setup.spec)
    devices = Devices(META, META)
    weights = DeviceWeights(model, devices)
    weights.setup(scheduler.residency(), scheduler.weight_buffer_bytes())
    worker = RealClockWorker(cost)
    runtime = Runtime(model, scheduler, devices, weights, dict.fromkeys(Lane, worker), None, Trace(name=name))
    state = StepState.create(model, [], devices, weights)

    def action_for(node: TaskNode) -> Action:
        return state.action(node) if node.op in BOOKKEEPING else None

    async def run() -> tuple[float, float]:
        wall = main = 0.0
        for step in steps:
            lanes_before, cpu, start = (
                sum(worker.host_seconds().values()),
                time.thread_time(),
                time.perf_counter(),
            )
            await runtime.run_plan(step, action_for, lambda request, s=step.step: routing.answer(s, request))
            wall += time.perf_counter() - start
            main_step = time.thread_time() - cpu
            main += main_step
            host = main_step + sum(worker.host_seconds().values()) - lanes_before
            if runtime.trace.steps:
                runtime.trace.steps[-1] = evolve(runtime.trace.steps[-1], host_seconds=host)
        return wall, main

    try:
        wall, main = runner(run())
    finally:
        runtime.close()
    host = {**worker.host_seconds(), "main": main}
    return RealtimeRun(len(steps), sum(r.seconds for r in virtual), wall, host, runtime.trace)


def with_realtime(setup: Setup, result: SimulationResult, runner: Runner = asyncio.run) -> SimulationResult:
    """`result` with its simulated steps run again on the real clock, under the policy it ran
    (unchanged if it could not run)."""
    if result.error is not None:
        return result
    simulation = Simulation(evolve(setup, policy=result.policy))
    return evolve(result, realtime=realtime_run(simulation, result.scheduler, runner=runner))
