"""The dataflow runtime as a StepRunner: a scheduler's plan, executed on real workers.

Per step: the scheduler emits the nodes of every layer and micro-batch, the
driver submits them to the executor with their actions bound to this step's
tensors, routing requests are answered from the gates' real output, and the
spans (and memory counters) go into the run's trace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from attrs import define, field

from flowmoe.core.driver import drive
from flowmoe.core.executor import Action, Executor, Span, Worker
from flowmoe.core.memory import MemoryNeed, gpu_need
from flowmoe.core.plan import ExpertCounts, Lane, Op, RoutingRequest, TaskNode
from flowmoe.core.policy import Policy
from flowmoe.core.routing_trace import RoutingTrace
from flowmoe.core.scheduling import MicroBatchShape, NodeFactory, Scheduler, SchedulerContext, StepShape
from flowmoe.devices.cuda import EventBook
from flowmoe.devices.factory import make_workers
from flowmoe.jobs.engine import StepInput
from flowmoe.model.moe_model import MoEModel
from flowmoe.runtime.actions import StepState
from flowmoe.runtime.device_weights import Devices, DeviceWeights
from flowmoe.runtime.pinned import pin_layers
from flowmoe.schedulers.registry import checked_plan, create
from flowmoe.traces.trace import CounterSample, Trace


def step_shape(step: int, inputs: Sequence[StepInput]) -> StepShape:
    shapes = tuple(
        MicroBatchShape.from_lengths(i.micro_batch, i.layout.counts, i.layout.past) for i in inputs
    )
    prefill = any(p == 0 for i in inputs for p in i.layout.past)
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
    _kv_bytes: int = 0

    @classmethod
    def create(
        cls,
        model: MoEModel,
        scheduler: str,
        policy: Policy | None = None,
        device: str = "auto",
        cost: Callable[[TaskNode], float] | None = None,
    ) -> Runtime:
        """`cost`: the latency model the scheduler plans with (a hardware profile's roofline)."""
        policy = policy or Policy()
        context = SchedulerContext(model.spec, policy, NodeFactory(model.spec), cost)
        plugin = create(scheduler, context)
        devices = Devices.detect(device)
        if devices.cuda:
            pin_layers(model)
        weights = DeviceWeights(model, devices)
        weights.setup(plugin.residency(), plugin.weight_buffer_bytes())
        workers, events = make_workers(devices.gpu, policy.cpu_threads)
        return cls(model, plugin, devices, weights, workers, events, Trace(name=scheduler))

    @property
    def kv_on_gpu(self) -> bool:
        return self.scheduler.kv_on_gpu()

    @property
    def cache_device(self) -> torch.device:
        return self.devices.gpu if self.kv_on_gpu else self.devices.cpu

    def check_memory(self, sequences: int, max_len: int, step_tokens: int) -> MemoryNeed:
        """Fail before the run if this scheduler's policy cannot fit the GPU budget."""
        spec, policy = self.model.spec, self.scheduler.context.policy  # type: ignore[attr-defined]
        kv = sequences * max_len * spec.kv_bytes_per_token
        if not self.kv_on_gpu:  # cache on the CPU: at most two layers' working copies (KV_LOAD) on the GPU
            kv = 2 * kv // spec.layers
        need = gpu_need(
            spec, self.scheduler.residency(), self.scheduler.weight_buffer_bytes(), kv, step_tokens, sequences
        )
        need.check(
            policy.gpu_memory,
            f"scheduler {self.scheduler.name} with {sequences} sequences of {max_len} tokens",
        )
        return need

    async def __call__(self, model: MoEModel, inputs: Sequence[StepInput]) -> list[torch.Tensor]:
        shape = step_shape(self.steps, inputs)
        self.steps += 1
        self._kv_bytes = sum(i.cache.nbytes for i in inputs)
        state = StepState.create(model, inputs, self.devices, self.weights)
        await self.run_plan(shape, state.action, self._answer(shape.step, state))
        return [state.logits[i.micro_batch] for i in inputs]

    async def run_plan(
        self,
        shape: StepShape,
        action_for: Callable[[TaskNode], Action],
        answer: Callable[[RoutingRequest], ExpertCounts],
    ) -> None:
        """One step's plan on this runtime's workers, its spans into the trace (the real-clock
        simulation calls it with bookkeeping-only actions and a routing trace's answers)."""
        executor = Executor(self.workers, on_span=self._sample)
        try:
            await drive(checked_plan(self.scheduler, shape), executor, action_for, answer)
        finally:
            if self.devices.cuda:
                torch.cuda.synchronize(self.devices.gpu)
            spans = executor.spans
            if self.events is not None:
                spans = [self.events.retime(s) for s in spans]
            self.trace.extend(spans)

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
        if span.node.op not in (Op.PAGE_COPY, Op.EVICT, Op.EMBED):
            return
        kv_device = "gpu" if self.kv_on_gpu else "cpu"
        if self.devices.cuda:
            gpu_bytes = torch.cuda.memory_allocated(self.devices.gpu)
        else:
            gpu_bytes = self.weights.nbytes + (self._kv_bytes if self.kv_on_gpu else 0)
        self.trace.counters.extend([
            CounterSample("gpu memory bytes", "gpu", span.end, gpu_bytes),
            CounterSample("gpu weight bytes", "gpu", span.end, self.weights.nbytes),
            CounterSample("gpu experts resident", "gpu", span.end, self.weights.resident_experts),
            CounterSample("kv cache bytes", kv_device, span.end, self._kv_bytes),
        ])  # fmt: skip

    def close(self) -> None:
        for worker in {id(w): w for w in self.workers.values()}.values():
            worker.close()
