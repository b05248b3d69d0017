"""The real-clock simulation (`flowmoe simulate --realtime`): the real host stack of a GPU run at
paper scale, every device action replaced by waiting the cost model's duration.

What runs for real: the scheduler (`Runtime.run_plan` on the simulation's scheduler), the driver,
the executor, one thread per lane (`RealClockWorker`), the runtime's counters and trace, the
weight-residency bookkeeping of PAGE_COPY and EVICT (`DeviceWeights` over a model whose weights are
torch `meta` tensors: shapes and bytes, no storage), and each GPU node's lookup of the weights it
uses (a plan that forgot a copy fails as in a real run). The tensor math is what the wait stands
for: the actions could run on meta tensors, but
torch's meta kernels are Python reference implementations (measured on the 2-vCPU VM, Mixtral,
64 decode sequences: pre-attention 1.6 ms, attention 0.6 ms per call), far more host time than a
CUDA launch of the same ops, so running them would charge the host for work a GPU run does not
do. Routing is answered from the simulation's routing (a trace or synthetic).
What the meta tensors leave out is charged as a model (`LaunchCosts`): the host time a CUDA run spends
launching each GPU node's torch operations, on the lane thread that launches them (`RealClockWorker`'s
`host`), with per-operation and per-node costs measured on the H200 run (issue 29), and, given a GPU
run's per-thread CPU record, the CPU its threads outside the stack (torch's, the driver's) spent per node.
The virtual-clock makespan of the same steps comes next to the wall clock's, so their ratio is
what the host stack costs a GPU run that the simulator does not see.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

import torch
from attrs import evolve, field, frozen

from flowmoe.core.cost import RooflineCost
from flowmoe.core.executor import Action, Span
from flowmoe.core.plan import ExpertCounts, Lane, Op, RoutingRequest, TaskNode
from flowmoe.core.scheduling import StepShape
from flowmoe.core.spec import ModelSpec
from flowmoe.core.thread_cpu import role
from flowmoe.devices.realclock import EVENT, NOW, STREAM, DeviceWaits, RealClockWorker, WaitMode, Waits, burn
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
ROUTED = frozenset({Op.GATE, Op.PREGATE})  # nodes whose routing the driver reads back
# GPU nodes that look their weights up where they are resident (NotResident when a plan forgot a copy)
USES_EXPERT = frozenset({Op.EXPERT_FFN})
USES_LAYER = frozenset({Op.PRE_ATTN, Op.GPU_ATTN, Op.POST_ATTN, Op.GATE, Op.PREGATE, Op.SHARED_FFN})
META = torch.device("meta")

# Host costs of a CUDA run's launches, measured on the H200 run (../shared/gpu-runs/2026-11-27-h200,
# NVIDIA H200 host, torch 2.11.0+cu130, Python 3.12; t4-cgopipe-trace.json.gz: cgopipe, Mixtral-8x7B x12
# layers, 32 prompts, 4 micro-batches, 16 GiB; its 15 decode steps). A gpu.compute span runs from the
# begin event to the end event recorded around the node's action (devices/cuda.py), so for a node whose
# kernels take microseconds (the dense per-layer nodes at decode: 8 rows per micro-batch) it is the time
# the launch thread took to dispatch them; the built-in model's trace (builtin-cgopipe-cuda-trace.json.gz,
# kernels of a toy model) shows the same spans (median pre_attn 401 / gpu_attn 665 / post_attn 222 /
# gate 472 / combine 206 us vs 389 / 615 / 212 / 451 / 259 us), so they are launch time, not kernel time.
# Least squares over those five kinds of median span (us) against torch operations per node
# (bench/step_counts.json, cgopipe at the H200 setting, views apart: 32.1 / 46 / 10 / 27.8 / 18.8):
# span = 80.9 us + 11.31 us x operations (r^2 = 0.92).
OP_SECONDS = 11.31e-6  # the slope: host time per torch operation dispatched and launched
NODE_SECONDS = 80.9e-6  # the intercept: a compute node's action's own host time beyond its operations
# Torch operations per node by kind (views apart), cgopipe at the H200 setting: ops_by_op / nodes_by_op of
# bench/step_counts.json at d625e31, GATE and LM_HEAD at eb265e2 (a routing's splits left to their
# readers; no gather of a decode step's last rows) (`ops_per_node`; tests/test_realtime_launch.py
# checks it against the file: re-run bench/step_counts.py after a cut, then regenerate this). That is
# the code as it is after
# issue 29 item 3's cuts: merged page runs, a layer's experts grouped per node, the device's experts in
# slots as CUDA takes them with FLOWMOE_EXPERT_SLOTS=1; GPU_ATTN counted on the AVX2 host's flash path,
# which CUDA does not take (736 -> 400 per step). The fit above used the counts of the code the H200 run
# ran (d976cd2: PAGE_COPY 7 per page node, EXPERT_FFN 6.45 per expert node). Kinds a row lacks are
# charged NODE_SECONDS only (GPU compute) or nothing (copies).
H200_OPS: Mapping[Op, float] = {
    Op.EMBED: 1.0, Op.PRE_ATTN: 11.58, Op.GPU_ATTN: 8.33, Op.POST_ATTN: 4.0, Op.GATE: 12.0,
    Op.EXPERT_FFN: 1.93, Op.COMBINE: 5.0, Op.LM_HEAD: 5.0, Op.PAGE_COPY: 1.47,
}  # fmt: skip


def ops_per_node(row: Mapping[str, Any]) -> dict[Op, float]:
    """Torch operations per node by kind from a bench/step_counts.json row (the CUDA-only page-copy
    operations in place of the CPU's own for PAGE_COPY)."""
    nodes = row["nodes_by_op"]
    ops = {Op[kind]: count / nodes[kind] for kind, count in row["ops_by_op"].items()}
    if nodes.get("PAGE_COPY"):
        ops[Op.PAGE_COPY] = row["cuda_page_copy_ops_per_step"] / nodes["PAGE_COPY"]
    return ops


# The CUDA worker's work around the spans above, read from the same trace by bench/launch_stats.py
# (t4-cgopipe-trace.json.gz, its 15 decode steps; `python bench/realtime_overhead.py --h200` measures
# it again): medians of a node's gap between launch-bound gpu.compute spans (the executor's hand-off,
# the next node off the lane's queue, two pooled events taken and recorded), of one more
# `stream.wait_event` (the gap before an expert FFN with one producer on gpu.h2d, less a node's gap),
# of an EVICT's span (`record_stream` on each tensor, its bookkeeping), and of a gate's end to its first
# expert FFN queued (the routing read-back: the counts' event waited for, `.tolist()`, the rows sliced
# by expert; the scheduler planning the layer's experts). Where the real clock runs part of an event
# for real, that part as it measures on the machine the real clock runs on is left out (never below
# zero): a node's gap less the real clock's own host time per GPU node of its lanes, a read-back less
# its own gate-to-first-expert time, both measured by the same bench without launch costs. The
# defaults below are that bench's "net" figures (bench/realtime_overhead.json, key "h200:item4", run on
# HEAD 0288ae2 on the 2-vCPU VM): H200 medians node gap 19.53 us (2,745 gaps), one more wait 5.75 us
# (3,848 gaps at 25.28 us), evict span 46.71 us (72 per step), gate end to first expert queued 310.21 us
# (48 per step); the real clock's own host per GPU node there 47.9 us and its own gate-to-expert 301.5 us.
NODE_GAP_SECONDS = 0.0  # 19.53 us less the real clock's own 47.9 us per GPU node
WAIT_SECONDS = 5.75e-6
EVICT_SECONDS = 46.71e-6  # its bookkeeping (a dict pop, counters) runs here too: a few us counted twice
READBACK_SECONDS = 8.7e-6  # 310.21 us less the real clock's own 301.5 us (load-dependent: 0 in a 1-step run)


@frozen
class LaunchCosts:
    """The host seconds a CUDA run spends around a node that the real clock does not run. On a GPU
    node's lane thread: `op_seconds` per torch operation it dispatches (`ops`: operations per node by
    kind), `node_seconds` for a compute node's action (PAGE_COPY and EVICT run their real bookkeeping
    here: only their operations are charged), `node_gap_seconds` for the worker's calls between two
    nodes, `wait_seconds` per producer on another GPU lane (a `stream.wait_event`), `evict_seconds`
    per EVICT. On the thread that answers a routing request: `readback_seconds`. Host-lane nodes are
    charged nothing (their modelled duration holds their thread). `other_seconds`: per GPU node, the
    CPU time of threads the runtime does not run (torch's, the CUDA driver's), in parallel with the
    stack: counted in the host time, burned on no thread (from a GPU run's per-thread record,
    `other_seconds_per_node`)."""

    op_seconds: float = OP_SECONDS
    node_seconds: float = NODE_SECONDS
    ops: Mapping[Op, float] = field(factory=lambda: dict(H200_OPS))
    node_gap_seconds: float = NODE_GAP_SECONDS
    wait_seconds: float = WAIT_SECONDS
    evict_seconds: float = EVICT_SECONDS
    readback_seconds: float = READBACK_SECONDS
    other_seconds: float = 0.0

    def __call__(self, node: TaskNode, waits: int = 0) -> float:
        """A GPU node's charge on its lane thread, `waits`: its producers on other GPU lanes."""
        if not node.lane.on_gpu:
            return 0.0
        own = 0.0 if node.op in BOOKKEEPING else self.node_seconds
        evict = self.evict_seconds if node.op == Op.EVICT else 0.0
        ops = self.op_seconds * self.ops.get(node.op, 0.0)
        return own + ops + self.node_gap_seconds + self.wait_seconds * waits + evict

    def charge(self, nodes: Sequence[TaskNode]) -> float:
        """The modelled host seconds of `nodes` (a run's: the sum its threads were charged), a
        read-back per gate and pre-gate among them."""
        lanes = {node.id: node.lane for node in nodes}
        reads = sum(node.op in ROUTED for node in nodes)
        launches = sum(self(node, cross_lane_waits(node, lanes)) for node in nodes)
        return launches + self.readback_seconds * reads

    def other(self, nodes: Sequence[TaskNode]) -> float:
        """The CPU seconds of threads outside the stack that `nodes` stand for (their GPU nodes')."""
        return self.other_seconds * sum(node.lane.on_gpu for node in nodes)


def cross_lane_waits(node: TaskNode, lanes: Mapping[int, Lane]) -> int:
    """How many of `node`'s producers ran on another GPU lane (`lanes`: node id -> lane): the CUDA
    worker's `stream.wait_event` calls for it (producers on host lanes are ordered by the executor)."""
    others = (lanes.get(dep) for dep in node.deps)
    return sum(1 for lane in others if lane is not None and lane.on_gpu and lane != node.lane)


# the real clock without launch costs (the host stack alone)
NO_LAUNCH = LaunchCosts(0.0, 0.0, {}, 0.0, 0.0, 0.0, 0.0)


def other_seconds_per_node(record: Mapping[str, Any], gpu_nodes_per_step: float) -> float:
    """From a GPU run's per-thread record (a bench/gpu.py row's "thread_cpu": CPU seconds per decode
    step by thread group, flowmoe/core/thread_cpu.py), the CPU seconds per GPU node of the threads
    that are neither the event loop's nor flowmoe's lanes, and of threads that exited inside a step
    (the process's CPU time less every live thread's, never below zero)."""
    groups = record["thread_cpu_s_per_step"]
    other = sum(seconds for group, seconds in groups.items() if role(group) == "other")
    exited = max(0.0, record["process_cpu_s_per_step"] - sum(groups.values()))
    return (other + exited) / gpu_nodes_per_step


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
    launch: LaunchCosts | None = None,
    waits: DeviceWaits | None = None,
    mode: WaitMode = NOW,
) -> RealtimeRun:
    """Scheduler `name` over `steps` (default: the simulation's) on the real clock, next to the same
    steps on the virtual clock. `runner` runs the coroutine (the CLI passes uvloop's); `launch`: the
    host cost of each GPU node's launches (default: the H200 run's, `LaunchCosts()`); `waits`: the
    host waits the CUDA worker's code makes (default: the code as it is, `DeviceWaits()`); `mode`:
    how CUDA waits (default: the code as it is on a one-GPU host, `NOW`). The CPU a thread spins away
    in its waits is in `host_seconds` apart, as "<thread> spins on <event | stream | device>"."""
    setup = simulation.setup
    steps = list(simulation.steps if steps is None else steps)
    cost = RooflineCost(setup.hardware, setup.spec)
    routing = simulation.trace
    virtual = run_steps(simulation.scheduler(name, simulation.popularity), steps, routing, cost)
    scheduler = simulation.scheduler(name, simulation.popularity)  # fresh: schedulers keep state
    model = model or meta_model(setup.spec)
    devices = Devices(META, META)
    weights = DeviceWeights(model, devices)
    weights.setup(scheduler.residency(), scheduler.weight_buffer_bytes())
    launch = LaunchCosts() if launch is None else launch
    lanes: dict[int, Lane] = {}  # node id -> lane, as the driver submits them: whose waits cross lanes
    waits = DeviceWaits() if waits is None else waits
    worker = RealClockWorker(cost, host=lambda node: launch(node, cross_lane_waits(node, lanes)), waits=waits)
    runtime = Runtime(model, scheduler, devices, weights, dict.fromkeys(Lane, worker), None, Trace(name=name))
    state = StepState.create(model, [], devices, weights)

    def action_for(node: TaskNode) -> Action:
        lanes[node.id] = node.lane
        if node.op in BOOKKEEPING:
            return state.action(node)
        if node.lane.on_gpu and node.op in USES_EXPERT:
            return lambda: weights.expert(node.layer, node.expert)
        if node.lane.on_gpu and node.op in USES_LAYER:
            return lambda: weights.layer(node.layer)
        return None

    def answer_for(step: int) -> Callable[[RoutingRequest], ExpertCounts]:
        def answer(request: RoutingRequest) -> ExpertCounts:
            worker.sync(request.after)  # the gate's counts read back to the host wait for the gate
            burn(launch.readback_seconds)  # the read-back's own host work, on the answering thread
            return routing.answer(step, request)

        return answer

    async def run() -> tuple[float, float]:
        wall = main = 0.0
        for step in steps:
            lanes.clear()
            busy, waited = sum(worker.host_seconds().values()), worker.sync_cpu_seconds
            cpu, start = time.thread_time(), time.perf_counter()
            await runtime.run_plan(step, action_for, answer_for(step.step))
            worker.synchronize()  # the step's device synchronize
            wall += time.perf_counter() - start
            main_step = time.thread_time() - cpu - (worker.sync_cpu_seconds - waited)
            main += main_step
            host = main_step + sum(worker.host_seconds().values()) - busy
            if runtime.trace.steps:
                runtime.trace.steps[-1] = evolve(runtime.trace.steps[-1], host_seconds=host)
        return wall, main

    try:
        wall, main = runner(run())
    finally:
        runtime.close()
    host = {**worker.host_seconds(), "main": main}
    spun = {(thread, on): s for (thread, on), s in worker.wait_seconds().items() if mode.spins(on)}
    host.update({spin_key(thread, on): seconds for (thread, on), seconds in spun.items()})
    if launch.other_seconds:
        host["other threads"] = launch.other([s.node for s in runtime.trace.spans])
    return RealtimeRun(len(steps), sum(r.seconds for r in virtual), wall, host, runtime.trace)


SPINS_ON = " spins on "  # a host_seconds key: a thread's CPU spun away waiting for the device


def spin_key(thread: str, waited_on: str) -> str:
    return f"{thread}{SPINS_ON}{waited_on}"


def split_spins(host: Mapping[str, float]) -> tuple[dict[str, float], Waits]:
    """A RealtimeRun's `host_seconds` -> the threads' CPU seconds of host work, and their spinning by
    (thread, what it waited on). Under `RUN4` every wait spins, so any other `WaitMode` is its
    `spun` of these."""
    cpu: dict[str, float] = {}
    waits: Waits = {}
    for key, seconds in host.items():
        thread, _, waited_on = key.partition(SPINS_ON)
        if waited_on:
            waits[(thread, waited_on)] = seconds
        else:
            cpu[key] = seconds
    return cpu, waits


@frozen
class HostReplay:
    """What `replay_host` found over a step: `waits`, seconds by (thread, what it waited on); `busy`,
    each thread's host seconds charged (`LaunchCosts`); `seconds`, the step's time with the
    launches in it (the simulated step's where the host never holds the device back)."""

    waits: Waits
    busy: dict[str, float]
    seconds: float


def replay_host(spans: Sequence[Span], launch: LaunchCosts, waits: DeviceWaits) -> HostReplay:
    """A step's host threads replayed against its simulated device timeline (`spans`: one step on
    the virtual clock), deterministically. Each GPU lane's thread launches its nodes in its stream's
    order, each taking `launch`'s charge for it (the H200 host's seconds), no earlier than the
    executor hands it over: its GPU producers launched, its host producers ended, and for a node
    reading a gate's routing, the driver's read-back of it done (the driver waits on the gate's event
    from its launch to its end, then `readback_seconds`). A node's device time (its simulated
    duration) begins once it is launched, its stream's previous node and its producers have ended.
    `waits.bound` holds a lane's thread (on an event) until its node that many back has ended; a
    node with `waits.syncs` holds it (on its stream) after its launch until the device reaches the
    node. A host node's thread waits (on events) for its GPU producers, then holds its duration."""
    ordered = sorted(spans, key=lambda s: (s.start, s.node.id))
    lanes = {s.node.id: s.node.lane for s in spans}
    start = min((s.start for s in spans), default=0.0)
    launched: dict[int, float] = {}  # GPU node -> when the executor heard it was launched
    answered: dict[int, float] = {}  # gate -> when the driver had its routing
    ends: dict[int, float] = {}  # node -> end of its device (or host) time, replayed
    cursor: dict[Lane, float] = {}  # lane -> when its thread is free
    free: dict[Lane, float] = {}  # GPU lane -> when its stream is free
    behind: dict[Lane, list[float]] = {}  # GPU lane -> its nodes' ends, in launch order
    waited: Waits = {}
    busy: dict[str, float] = {}
    driver = start

    def wait(thread: str, on: str, since: float, until: float) -> float:
        waited[(thread, on)] = waited.get((thread, on), 0.0) + max(0.0, until - since)
        return max(since, until)

    for span in ordered:
        node, lane, duration = span.node, span.node.lane, span.end - span.start
        deps = [d for d in node.deps if d in lanes]
        handed = max([cursor.get(lane, start), *(launched.get(d, ends[d]) for d in deps),
                      *(answered[d] for d in deps if d in answered)])  # fmt: skip
        producers = max((ends[d] for d in deps), default=start)
        if not lane.on_gpu:  # `wait_host` on its GPU producers' events, then its own time
            began = wait(str(lane), EVENT, handed, producers)
            cursor[lane] = ends[node.id] = began + duration
            continue
        mine, bound = behind.setdefault(lane, []), waits.bound(lane)
        if bound and len(mine) >= bound:
            handed = wait(str(lane), EVENT, handed, mine[-bound])
        charge = launch(node, cross_lane_waits(node, lanes))
        busy[str(lane)] = busy.get(str(lane), 0.0) + charge
        done = handed + charge
        began = max(done, free.get(lane, start), producers)
        if waits.syncs.get(node.op):
            done = wait(str(lane), STREAM, done, began)
        cursor[lane] = launched[node.id] = done  # the executor hears of it once the action returns
        free[lane] = ends[node.id] = began + duration
        mine.append(ends[node.id])
        if node.op in ROUTED:  # the driver reads the routing back, in plan order
            driver = wait("main", EVENT, max(driver, done), ends[node.id]) + launch.readback_seconds
            answered[node.id] = driver
    return HostReplay(waited, busy, max([*ends.values(), *launched.values()], default=start) - start)


def with_realtime(setup: Setup, result: SimulationResult, runner: Runner = asyncio.run) -> SimulationResult:
    """`result` with its simulated steps run again on the real clock, under the policy it ran
    (unchanged if it could not run)."""
    if result.error is not None:
        return result
    simulation = Simulation(evolve(setup, policy=result.policy))
    return evolve(result, realtime=realtime_run(simulation, result.scheduler, runner=runner))
