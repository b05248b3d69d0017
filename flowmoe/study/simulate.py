"""Simulate schedulers on the SimWorker under a virtual clock: single plans, or a whole workload batch.

`simulate` runs given steps' plans back to back, routing from a trace. A
workload simulation builds a batch of N = μ x micro-batches requests sampled
from the workload, runs its prefill and decode steps through the real
scheduler with the roofline cost of a hardware spec, and reports throughput as
the papers define it: generated tokens / (prefill + decode time). Decode steps
change slowly (one more key per step), so only `decode_samples` of them
(first, last and evenly between) are simulated and the others interpolated
linearly; `decode_samples=0` simulates every step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from attrs import Factory, evolve, frozen

from flowmoe.core.cost import RooflineCost
from flowmoe.core.driver import drive
from flowmoe.core.errors import FlowmoeError
from flowmoe.core.executor import Executor, Span
from flowmoe.core.hardware import HardwareSpec
from flowmoe.core.host_costs import IDEAL, family
from flowmoe.core.memory import MemoryNeed, gpu_memory, host_memory
from flowmoe.core.plan import Lane, Op, TaskNode
from flowmoe.core.policy import Policy
from flowmoe.core.routing_trace import RoutingTrace
from flowmoe.core.scheduling import (
    BatchShape,
    MicroBatchShape,
    NodeFactory,
    Scheduler,
    SchedulerContext,
    StepShape,
)
from flowmoe.core.spec import ModelSpec
from flowmoe.core.synthetic_routing import RoutingModel, SyntheticRouting, observed_popularity
from flowmoe.core.workloads import Workload
from flowmoe.devices.sim import SimWorker, run_virtual
from flowmoe.schedulers.registry import create, load
from flowmoe.study.sim_report import (
    SimulationResult,
    StepRun,
    TokenLatency,
    batch_trace,
    interpolated,
    on_cpu,
    trace_stats,
)

# the nodes that ran decode's attention, and its routed experts (a whole LAYER runs both where it runs)
ATTENTION = frozenset({Op.CPU_ATTN, Op.GPU_ATTN, Op.LAYER})
EXPERTS = frozenset({Op.EXPERT_FFN, Op.LAYER})


def run_steps(
    scheduler: Scheduler, steps: Sequence[StepShape], trace: RoutingTrace, cost: Callable[[TaskNode], float]
) -> list[StepRun]:
    """Every step's plan through one executor per step, back to back on one virtual clock."""

    async def run() -> list[StepRun]:
        import asyncio

        loop = asyncio.get_running_loop()
        worker = SimWorker(cost)
        runs: list[StepRun] = []
        for step in steps:
            executor = Executor(dict.fromkeys(Lane, worker), clock=loop.time)
            answer = lambda request, s=step.step: trace.answer(s, request)  # noqa: E731
            started = loop.time()
            await drive(scheduler.plan(step), executor, lambda _node: None, answer)
            runs.append(StepRun(step, started, loop.time(), tuple(executor.spans)))
        return runs

    return run_virtual(run())


def simulate(
    scheduler: Scheduler, steps: Sequence[StepShape], trace: RoutingTrace, cost: Callable[[TaskNode], float]
) -> list[Span]:
    return [span for run in run_steps(scheduler, steps, trace, cost) for span in run.spans]


@frozen
class Setup:
    """What a workload simulation runs: model, hardware, workload, policy and routing."""

    spec: ModelSpec
    hardware: HardwareSpec
    workload: Workload
    policy: Policy
    routing: RoutingModel = Factory(RoutingModel)
    recorded: RoutingTrace | None = None  # a routing trace from a real run, replayed or resampled
    decode_samples: int = 4
    seed: int = 0
    weights_pinned: bool = True  # False: simulate a system whose CPU weight copies are pageable
    kernel_share: tuple[tuple[Op, float], ...] = ()  # ops whose kernels reach a share of the GEMM rate
    kv_pool: bool = False  # True: a system whose KV cache is a token pool (its batch's tokens, no padding)
    host_costs: bool = True  # False: every scheduler at flowmoe's own host costs (`host_costs.IDEAL`)

    @property
    def budget(self) -> int:
        return self.policy.gpu_memory if self.policy.gpu_memory is not None else self.hardware.gpu_memory


def batch_steps(
    prompts: Sequence[int], gen: int, micro_batch: int, decode: Sequence[int] | None = None
) -> list[StepShape]:
    """Prefill (step 0) and the gen - 1 decode steps of one batch in micro-batches of `micro_batch`;
    with `decode`, only those decode steps (0-based among the decode steps)."""
    groups = [list(prompts[i : i + micro_batch]) for i in range(0, len(prompts), micro_batch)]
    prefill = tuple(MicroBatchShape.from_lengths(i, g, [0] * len(g)) for i, g in enumerate(groups))
    steps = [StepShape(0, True, prefill)]
    for j in range(1, gen) if decode is None else (d + 1 for d in decode):
        shapes = tuple(
            MicroBatchShape.from_lengths(i, [1] * len(g), [p + j - 1 for p in g])
            for i, g in enumerate(groups)
        )
        steps.append(StepShape(j, False, shapes))
    return steps


def sampled(count: int, samples: int) -> list[int]:
    """Indices 0..count-1 to simulate: all, or `samples` evenly spread including both ends."""
    if samples <= 0 or samples >= count:
        return list(range(count))
    if samples == 1:
        return [0]
    return sorted({round(i * (count - 1) / (samples - 1)) for i in range(samples)})


class Simulation:
    """One setup's batch, steps and routing, shared by every scheduler simulated on it."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        policy = setup.policy
        self.prompts = setup.workload.sample(policy.batch_size, setup.seed)
        self.decode_count = setup.workload.gen_len - 1
        at = sampled(self.decode_count, setup.decode_samples)
        self.steps = batch_steps(self.prompts, setup.workload.gen_len, policy.micro_batch_size, at)
        self.policy = policy if policy.gpu_memory is not None else evolve(policy, gpu_memory=setup.budget)
        self._routed: tuple[RoutingTrace, tuple[tuple[float, ...], ...] | None] | None = None
        self.cost = RooflineCost(setup.hardware, setup.spec, kernel_share=setup.kernel_share)

    @property
    def trace(self) -> RoutingTrace:
        return self._routes()[0]

    @property
    def popularity(self) -> tuple[tuple[float, ...], ...] | None:
        return self._routes()[1]

    @popularity.setter
    def popularity(self, shares: tuple[tuple[float, ...], ...] | None) -> None:
        self._routed = (self.trace, shares)

    def _routes(self) -> tuple[RoutingTrace, tuple[tuple[float, ...], ...] | None]:
        """The routing, built on first use (a memory check needs none)."""
        if self._routed is None:
            self._routed = self._routing(self.setup.spec)
        return self._routed

    def _routing(self, spec: ModelSpec) -> tuple[RoutingTrace, tuple[tuple[float, ...], ...]]:
        setup, uniform = self.setup, tuple(1 / spec.moe.experts for _ in range(spec.moe.experts))
        if setup.recorded is None:
            routing = SyntheticRouting(spec, setup.routing)
            return routing.trace(self.steps), routing.popularity
        seen = tuple(shares or uniform for shares in observed_popularity(spec, setup.recorded))
        if _covers(setup.recorded, spec, self.steps):
            return setup.recorded, seen
        return SyntheticRouting.observed(spec, setup.recorded, setup.routing).trace(self.steps), seen

    def scheduler(self, name: str, popularity: tuple[tuple[float, ...], ...] | None = None) -> Scheduler:
        """Scheduler `name` built for this setup's policy (placing by `popularity` where given)."""
        setup = self.setup
        cost = self.cost_of(name)
        kv_host = self.batch().total_slots * setup.spec.kv_bytes_per_token
        host = setup.hardware.cpu_memory - kv_host  # the weights' share
        factory = NodeFactory(
            setup.spec, expert_format=self.policy.expert_format, attention_format=self.policy.attention_format
        )
        context = SchedulerContext(setup.spec, self.policy, factory, cost, popularity,
                                   weights_pinned=setup.weights_pinned, host_weight_bytes=host)  # fmt: skip
        return create(name, context)

    def cost_of(self, name: str) -> RooflineCost:
        """The cost model scheduler `name` runs under: the setup's, with the host costs of the system
        family the scheduler stands for (its `host_family` class attribute; none: flowmoe's own)."""
        named = getattr(load(name), "host_family", IDEAL.name) if self.setup.host_costs else IDEAL.name
        return evolve(self.cost, host=family(named))

    def _base(self, name: str, need: MemoryNeed, scheduler: Scheduler | None = None) -> SimulationResult:
        """A result of scheduler `name` for this policy, as the scheduler ran it: a CPU-only one's
        (`Scheduler.uses_gpu`) with everything placed on the CPU, whatever the policy's placements."""
        generated, policy = len(self.prompts) * self.setup.workload.gen_len, self.setup.policy
        if scheduler is not None and not scheduler.uses_gpu():
            policy = evolve(policy, attention_on="cpu", ffn_on="cpu", weights_gpu_share=0.0, kv_gpu_share=0.0)
        return SimulationResult(name, policy, len(self.prompts), sum(self.prompts), generated, need)

    def _over(self, base: SimulationResult) -> SimulationResult | None:
        budget = self.setup.budget
        if base.memory.total <= budget:
            return None
        return evolve(base, error=f"needs {base.memory.describe()}, over the {budget / 2**30:.1f} GiB GPU")

    def refusal(self, name: str) -> SimulationResult | None:
        """Why scheduler `name` cannot run this policy (its memory accounting), or None: it fits.
        Builds no routing: the check is cheap next to a run."""
        scheduler = self.scheduler(name, None)
        base = self._base(name, self._memory(scheduler), scheduler)
        return self._over(base) or self._host_over(base, scheduler)

    def need(self, name: str) -> MemoryNeed:
        """The GPU memory scheduler `name` takes for this policy (its own accounting)."""
        return self._memory(self.scheduler(name, None))

    def failed(self, name: str, why: str) -> SimulationResult:
        """A result that records why scheduler `name` refused this policy."""
        return evolve(self._base(name, MemoryNeed(0, 0, 0, 0)), error=why)

    def run(self, name: str) -> SimulationResult:
        scheduler = self.scheduler(name, self.popularity)
        base = self._base(name, self._memory(scheduler), scheduler)
        over = self._over(base) or self._host_over(base, scheduler)
        if over is not None:
            return over
        try:
            runs = run_steps(scheduler, self.steps, self.trace, self.cost_of(name))
        except FlowmoeError as exc:
            return evolve(base, error=str(exc))
        prefill, decode = runs[0], runs[1:]
        indices = [s.step.step - 1 for s in decode]
        trace = batch_trace(name, runs, indices, self.decode_count)
        steps = interpolated([r.seconds for r in decode], indices, self.decode_count)
        decoded = [span for run in decode for span in run.spans]
        report = scheduler.report()
        held = round(report.get("expert_cache_slots", len(scheduler.residency().experts)))
        moe = sum(self.setup.spec.is_moe_layer(layer) for layer in range(self.setup.spec.layers))
        return evolve(base, prefill_seconds=prefill.seconds, decode_seconds=sum(steps),
                      stats=trace_stats(trace), trace=trace, simulated_steps=len(runs),
                      simulated_seconds=sum(r.seconds for r in runs), token_latency=TokenLatency.of(steps),
                      gpu_experts=held, experts_per_layer=held / moe if moe else None,
                      report=tuple(sorted(report.items())), cpu_attention=on_cpu(decoded, ATTENTION),
                      cpu_experts=on_cpu(decoded, EXPERTS))  # fmt: skip

    def batch(self) -> BatchShape:
        """The batch as the memory check sees it: the engine sizes each micro-batch's cache for its
        longest prompt (a token pool, `Setup.kv_pool`: each sequence's own tokens)."""
        mu, setup = self.policy.micro_batch_size, self.setup
        return BatchShape.of(self.prompts, mu, setup.workload.gen_len, pool=setup.kv_pool)

    def _host_over(self, base: SimulationResult, scheduler: Scheduler) -> SimulationResult | None:
        """The host-memory refusal (weights off the GPU + the CPU-side KV cache), or None: it fits."""
        why = host_memory(scheduler, self.batch()).refusal(
            self.setup.hardware, "this policy", scheduler.disk_tier()
        )
        return None if why is None else evolve(base, error=why)

    def _memory(self, scheduler: Scheduler) -> MemoryNeed:
        return gpu_memory(scheduler, self.batch())


def _covers(trace: RoutingTrace, spec: ModelSpec, steps: Sequence[StepShape]) -> bool:
    return all(
        (step.step, layer, mb.index) in trace.counts
        for step in steps
        for mb in step.micro_batches
        for layer in range(spec.layers)
        if spec.is_moe_layer(layer)
    )
