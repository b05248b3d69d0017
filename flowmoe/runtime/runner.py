"""The dataflow runtime as a StepRunner: a scheduler's plan, executed on real workers.

Per step: the scheduler emits the nodes of every layer and micro-batch, the
driver submits them to the executor with their actions bound to this step's
tensors, routing requests are answered from the gates' real output, and the
spans (and memory counters) go into the run's trace when one is kept
(`record`): without it a run keeps nothing per node, so a long job runs in
bounded memory. A plan may emit at most a budget of nodes per step, derived
from the model (`node_budget`), so no policy can make a step's plan grow
without bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from attrs import Factory, define, field

from flowmoe.core.driver import drive
from flowmoe.core.executor import Action, Executor, Span, Worker
from flowmoe.core.memory import MemoryNeed, check_batch_size, gpu_memory
from flowmoe.core.plan import ExpertCounts, Lane, Op, RoutingRequest, TaskNode
from flowmoe.core.policy import Policy
from flowmoe.core.routing_trace import RoutingTrace
from flowmoe.core.scheduling import (
    BatchShape,
    MicroBatchShape,
    NodeBudget,
    NodeFactory,
    Scheduler,
    SchedulerContext,
    StepShape,
)
from flowmoe.core.spec import ModelSpec
from flowmoe.devices.cuda import EventBook
from flowmoe.devices.factory import make_workers
from flowmoe.jobs.engine import StepInput
from flowmoe.kernels.kv_cache import Homes, SlotSplit
from flowmoe.model.moe_model import MoEModel
from flowmoe.runtime.actions import StepState
from flowmoe.runtime.device_weights import Devices, DeviceWeights
from flowmoe.runtime.pinned import pin_layers, unpin
from flowmoe.schedulers.registry import checked_plan, create
from flowmoe.schedulers.shared_options import MAX_PAGES_PER_EXPERT
from flowmoe.traces.trace import CounterSample, Trace

NODES_PER_WEIGHT = 16  # compute, copy and evict nodes one expert (or dense part) may need per micro-batch
SAMPLED_AFTER = frozenset({Op.PAGE_COPY, Op.EVICT, Op.EMBED})  # memory counters move (EMBED: a step begins)


def node_budget(spec: ModelSpec, scheduler: str, micro_batches: int) -> NodeBudget:
    """At most every weight of every layer touched by every micro-batch, each copied in at most
    MAX_PAGES_PER_EXPERT pages: far above what any built-in scheduler plans (cgopipe at
    Mixtral-8x7B, 4 micro-batches: ~6,150 nodes against ~313,000), far below a plan gone wild."""
    weights = spec.layers * micro_batches * (spec.moe.experts + 1)
    refusal = (
        f"scheduler {scheduler} plans too many nodes for one step of this model: each {spec.expert_bytes} B "
        f"expert may be copied in at most {MAX_PAGES_PER_EXPERT} pages, so where it pages weights a "
        f"--page-size of at least {-(-spec.expert_bytes // MAX_PAGES_PER_EXPERT)} B"
    )
    return NodeBudget(weights * (NODES_PER_WEIGHT + MAX_PAGES_PER_EXPERT) + 64, refusal)


def step_shape(step: int, inputs: Sequence[StepInput]) -> StepShape:
    shapes = tuple(
        MicroBatchShape.from_lengths(i.micro_batch, i.layout.counts, i.layout.past) for i in inputs
    )
    # a prompt's step: its first tokens, or a later chunk of it (jobs/prefill_chunks.py: several tokens
    # of one sequence over a cache it already has); a decode step brings one token a sequence
    prefill = any(
        p == 0 or c > 1 for i in inputs for c, p in zip(i.layout.counts, i.layout.past, strict=True)
    )
    return StepShape(step, prefill, shapes)


@define
class Runtime:
    model: MoEModel
    scheduler: Scheduler
    devices: Devices
    weights: DeviceWeights
    workers: dict[Lane, Worker]
    events: EventBook | None
    trace: Trace = field(factory=Trace)
    steps: int = 0
    routing: RoutingTrace | None = None  # when set, every gate's (and pre-gate's) answer is recorded
    record: bool = True  # keep every span and memory counter in `trace` (False: keep nothing per node)
    kv_gpu: frozenset[int] = field(  # layers whose KV cache lives on the GPU (the scheduler's word)
        default=Factory(lambda s: s.scheduler.kv_gpu_layers(), takes_self=True)
    )
    pinned: list[torch.Tensor] = field(factory=list)  # host arenas this runtime page-locked (CUDA)
    closed: bool = False
    _kv_bytes: dict[str, int] = field(factory=dict)  # "gpu" / "cpu" -> the step's KV cache bytes there
    _budgets: dict[int, NodeBudget] = field(factory=dict)  # micro-batches -> the step's node budget

    @classmethod
    def create(
        cls,
        model: MoEModel,
        scheduler: str,
        policy: Policy | None = None,
        device: str = "auto",
        cost: Callable[[TaskNode], float] | None = None,
        record: bool = True,
        popularity: tuple[tuple[float, ...], ...] | None = None,
    ) -> Runtime:
        """`cost`: the latency model the scheduler plans with (a hardware profile's roofline);
        `record`: keep a trace of every node (what --trace writes); `popularity`: each expert's
        token share per layer (a recorded routing trace's), for schedulers that place by it."""
        policy = policy or Policy()
        factory = NodeFactory(model.spec, expert_format=policy.expert_format)
        context = SchedulerContext(model.spec, policy, factory, cost, popularity)
        plugin = create(scheduler, context)
        devices = Devices.detect(device)
        pinned = []
        if devices.cuda:
            cap_allocator(devices.gpu, policy.gpu_memory)
            pinned = pin_layers(model)
        weights = DeviceWeights(model, devices, expert_format=policy.expert_format)
        try:
            residency, buffers = plugin.residency(), plugin.weight_buffer_bytes()
            weights.setup(residency, buffers, policy.gpu_memory, ends=plugin.uses_gpu())
        except BaseException:
            weights.close()
            unpin(pinned)
            raise
        workers, events = make_workers(devices.gpu, policy.cpu_threads)
        emulated = not devices.cuda and plugin.uses_gpu()  # a CPU-only schedule has no gpu.* lane to emulate
        trace = Trace(name=scheduler, gpu_emulated=emulated)
        return cls(model, plugin, devices, weights, workers, events, trace, record=record, pinned=pinned)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    @property
    def kv_on_gpu(self) -> bool:
        """Every layer's KV cache lives on the GPU."""
        return len(self.kv_gpu) == self.model.spec.layers

    @property
    def cache_device(self) -> Homes:
        """Where the engine allocates the KV cache: one device for every layer, each layer's where the
        scheduler splits it by layer, or every layer split by sequence (`SlotSplit`) where it keeps
        some sequences of each CPU-homed layer on the GPU (`kv_gpu_sequences`)."""
        gpu, cpu = self.devices.gpu, self.devices.cpu
        if self.kv_on_gpu:
            return gpu
        if self.kv_gpu:
            return tuple(gpu if layer in self.kv_gpu else cpu for layer in range(self.model.spec.layers))
        scheduler = self.scheduler
        split = scheduler.kv_gpu_sequences(scheduler.context.policy.micro_batch_size) > 0
        return SlotSplit(gpu, scheduler.kv_gpu_sequences, cpu) if split else cpu

    def check_memory(self, batch: BatchShape) -> MemoryNeed:
        """Fail before the run if this scheduler's policy cannot fit the GPU budget with `batch` (the
        largest batch the run holds at once): `core.memory.gpu_memory`, the simulator's figure."""
        need = gpu_memory(self.scheduler, batch)
        sequences = sum(len(g) for g in batch.prompts)
        longest = max(p for g in batch.prompts for p in g) + batch.gen
        who = f"scheduler {self.scheduler.name} with {sequences} sequences of up to {longest} tokens"
        need.check(self.scheduler.context.policy.gpu_memory, who)
        check_batch_size(self.scheduler, batch, who)
        return need

    async def __call__(self, model: MoEModel, inputs: Sequence[StepInput]) -> list[torch.Tensor]:
        shape = step_shape(self.steps, inputs)
        self.steps += 1
        if self.record:  # read by the memory counters alone
            self._kv_bytes = self._cache_bytes(inputs)
        state = StepState.create(model, inputs, self.devices, self.weights, self.events, self.kv_gpu)
        await self.run_plan(shape, state.action, self._answer(shape.step, state))
        if self.routing is not None:  # what nodes that gate on their own decided (a whole layer's)
            for key in state.routings.unasked:
                self.routing.record(shape.step, state.expert_counts(RoutingRequest(*key, after=-1)))
        return [state.acts.logits[i.micro_batch] for i in inputs]

    async def run_plan(
        self,
        shape: StepShape,
        action_for: Callable[[TaskNode], Action],
        answer: Callable[[RoutingRequest], ExpertCounts],
    ) -> None:
        """One step's plan on this runtime's workers, its spans into the trace (the real-clock
        simulation calls it with bookkeeping-only actions and a routing trace's answers)."""
        record = self.record
        executor = Executor(self.workers, on_span=self._sample if record else None, keep_spans=record)
        budget = self._budget(len(shape.micro_batches))
        cpu = time.process_time() if record else 0.0
        try:
            await drive(checked_plan(self.scheduler, shape), executor, action_for, answer, budget)
        finally:
            # The host already waited for what it reads (logits, routing counts, copies to the
            # host); the device is waited for here only to date a recorded step's GPU spans.
            spans = executor.spans if record else None
            if self.events is not None:
                spans = self.events.end_step(spans)
            if record:  # with the process's CPU time in the step (host time per step)
                assert spans is not None, "a recorded step's spans"
                self.trace.extend(spans, host_seconds=time.process_time() - cpu)

    def _budget(self, micro_batches: int) -> NodeBudget:
        """`node_budget` for this runtime's model and scheduler (made once per micro-batch count)."""
        budget = self._budgets.get(micro_batches)
        if budget is None:
            name = self.scheduler.name
            budget = self._budgets[micro_batches] = node_budget(self.model.spec, name, micro_batches)
        return budget

    def _cache_bytes(self, inputs: Sequence[StepInput]) -> dict[str, int]:
        """The step's KV cache bytes on each side that homes cache layers or parts of them: "gpu", "cpu"."""
        split: dict[str, int] = {}
        for layer in range(self.model.spec.layers):
            side = "gpu" if layer in self.kv_gpu else "cpu"
            for i in inputs:
                kept, rest = i.cache.parts(layer)
                split[side] = split.get(side, 0) + sum(t.nbytes for t in rest)
                if kept is not None:
                    split["gpu"] = split.get("gpu", 0) + sum(t.nbytes for t in kept)
        return split

    def _answer(self, step: int, state: StepState) -> Callable[[RoutingRequest], ExpertCounts]:
        """Routing answers from the gates' output, recorded into `routing` when one is attached."""
        routing = self.routing
        if routing is None:
            return state.expert_counts

        def answer(request: RoutingRequest) -> ExpertCounts:
            counts = state.expert_counts(request)
            routing.record(step, counts, request.speculative)
            return counts

        return answer

    def _sample(self, span: Span) -> None:
        """Memory counters after every node that changes them (and at each step's first node)."""
        if span.node.op not in SAMPLED_AFTER:
            return
        if self.devices.cuda:
            gpu_bytes = torch.cuda.memory_allocated(self.devices.gpu)
        else:
            gpu_bytes = self.weights.nbytes + self._kv_bytes.get("gpu", 0)
        self.trace.counters.extend([
            CounterSample("gpu memory bytes", "gpu", span.end, gpu_bytes),
            CounterSample("gpu weight bytes", "gpu", span.end, self.weights.nbytes),
            CounterSample("gpu experts resident", "gpu", span.end, self.weights.resident_experts),
            *(CounterSample("kv cache bytes", side, span.end, n) for side, n in self._kv_bytes.items()),
        ])  # fmt: skip

    def close(self) -> None:
        """Release everything the run holds on the device and for it: the lanes' threads and streams,
        the device weights (and their share of the process's GPU ledger), the events, the page-locked
        registrations this runtime made; torch's cached GPU blocks go back to the driver. The trace
        stays. Closing twice is a no-op."""
        if self.closed:
            return
        self.closed = True
        for worker in {id(w): w for w in self.workers.values()}.values():
            worker.close()
        self.workers.clear()
        self.weights.close()
        if self.events is not None:
            self.events.close()
            self.events = None
        unpin(self.pinned)
        self.pinned.clear()
        if self.devices.cuda:
            torch.cuda.synchronize(self.devices.gpu)
            torch.cuda.empty_cache()


def cap_allocator(gpu: torch.device, budget: int | None) -> None:
    """Hold torch's CUDA caching allocator to the --gpu-memory budget as well, so an emulated small
    GPU (a T4's 16 GiB on an H100) fails where the small GPU would, not only in flowmoe's accounting;
    no budget lifts a cap an earlier runtime of this process set."""
    total = torch.cuda.get_device_properties(gpu).total_memory
    fraction = 1.0 if budget is None else min(1.0, budget / total)
    torch.cuda.set_per_process_memory_fraction(fraction, gpu)
