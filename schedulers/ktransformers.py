"""`ktransformers`: KTransformers' CPU/GPU hybrid placement (Chen et al., "KTransformers: Unleashing the
Full Potential of CPU/GPU Hybrid Inference for MoE Models", SOSP '25; code kvcache-ai/ktransformers).

Placement (the paper's hybrid design: attention and shared experts on the GPU,
routed experts on the CPU, each where its arithmetic intensity fits): every
layer's dense part (attention, router, shared expert or dense MLP) and the KV
cache live on the GPU; the routed experts live in host memory and are computed
there, next to their weights. KTransformers' optimize rules may put whole
layers' experts on the GPU instead (its rule files match layers by index);
here the first round(`weights_gpu_share` x MoE layers) MoE layers keep their
experts on the GPU and the rest are computed on the CPU (`--ffn-on cpu`: every
MoE layer's, whatever the share).

Per layer and micro-batch: attention, the gate (GPU); then the layer's routed
experts on the CPU (HIDDEN_OFFLOAD, one EXPERT_FFN per routed expert on
cpu.compute, EXPERT_LOAD of the outputs: KTransformers submits the whole
layer's routed experts to its CPU MoE kernel at once and returns one output),
while the GPU computes the shared expert, which depends only on the attention
output: the CPU and GPU overlap within the layer (the paper's asynchronous
CPU-GPU task scheduling); COMBINE waits for both.

Expert Deferral (the paper's accuracy-aware mechanism): with K > 0, K of a
layer's routed experts would add their output into the *next* layer's
residual, so the CPU keeps computing them while the GPU runs the next
attention; that changes the model's outputs (the paper reports an average
accuracy drop of at most 0.5% for up to 1.45x throughput). flowmoe offers
K = 0 only, which is exact (eager's tokens): deferral needs a combine that
leaves experts out and a next layer that adds them (flowmoe/runtime/actions.py,
flowmoe/model) and a knob to opt in (flowmoe/core/policy.py, the CLI), none of
which this scheduler's files reach; there is no K to pass and nothing deferred.

Deviations: no AMX/AVX-512 kernels, CUDA graph of the decode step or
NUMA-aware expert sharding: the CPU expert's time is the cost model's (a
hardware preset or a `flowmoe calibrate` profile); no expert deferral (above).
`--attention-on cpu` is refused (KTransformers keeps attention on the GPU).
"""

from __future__ import annotations

from typing import ClassVar

from flowmoe.core.plan import Lane, Op
from flowmoe.core.scheduling import MicroBatchShape, PlanStream, Residency, SchedulerContext, StepShape
from flowmoe.schedulers._layer_nodes import (
    check_placement,
    cpu_experts,
    gate_and_route,
    model_order,
    moe_layers,
)


class KTransformersScheduler:
    name: ClassVar[str] = "ktransformers"
    summary: ClassVar[str] = (
        "KTransformers hybrid placement: routed experts on the CPU (the first weights_gpu_share of MoE "
        "layers on the GPU), attention and shared experts on the GPU, overlapping; no expert deferral "
        "(K = 0: exact)"
    )

    def __init__(self, context: SchedulerContext) -> None:
        self.context = context
        check_placement(self.name, context.policy, ffn=("gpu", "cpu"))
        moe = moe_layers(context.spec) if context.policy.ffn_on == "gpu" else []
        self.on_gpu = frozenset(moe[: round(context.policy.weights_gpu_share * len(moe))])

    def residency(self) -> Residency:
        spec = self.context.spec
        experts = frozenset((layer, e) for layer in self.on_gpu for e in range(spec.moe.experts))
        return Residency(Residency.dense_only(spec).dense, experts)

    def weight_buffer_bytes(self) -> int:
        return 0

    def kv_on_gpu(self) -> bool:
        return True

    def plan(self, step: StepShape) -> PlanStream:
        return model_order(self.context.factory, self.context.spec, step, self._experts)

    def _experts(self, layer: int, mb: MicroBatchShape, post: int) -> PlanStream:
        f = self.context.factory
        gate, counts = yield from gate_and_route(f, layer, mb, post)
        if layer in self.on_gpu:
            ffns = [
                f.node(Op.EXPERT_FFN, Lane.GPU_COMPUTE, layer, mb, e, deps=[gate], tokens=n)
                for e, n in counts.counts
            ]
            yield from ffns
            return [n.id for n in ffns]
        on_cpu = cpu_experts(f, layer, mb, gate, counts.counts)
        yield from on_cpu
        return [on_cpu[-1].id] if on_cpu else []
